"""What decode has agreed with prefill: the limits it enforces, or why it refuses everything.

Written by the handshake (or by `agree_locally` with --local-prefill) and read by the
GenerationService, both on the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from decode_svc.validation import DecodeLimits


@dataclass
class DecodeState:
    """Facts learned from prefill at start (the handshake); None until agreed."""

    limits: DecodeLimits | None = None
    refusing: str = ""  # why decode refuses everything (model or layout disagree)
    plane: str = "inline"  # the data plane agreed with prefill (decode_svc.plane_select)
