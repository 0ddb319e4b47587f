"""Deliberately broken variants of our services, each breaking ONE rule of SPEC.md, so the
tests can show the conformance suite catches them. Never imported by the services."""
