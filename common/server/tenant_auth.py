"""Decode's client-API auth by tenant: the interceptor, its metrics and the SIGHUP reload.

Metrics, with bounded cardinality: `kvhandoff_api_calls_total{tenant}` counts the calls the
interceptor checked; `tenant` is only ever a name of a table that was in force (the tokens
file's names, or "default" for --api-token) or "unauthenticated" for a refused call, never a
token or anything else a client sent. `kvhandoff_api_tokens_reloads_total{result}` counts
reloads (failed: the previous table stays); `kvhandoff_api_tenants` and `kvhandoff_api_tokens`
are the table in force.
"""

from __future__ import annotations

import asyncio
import signal

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.server.auth import BearerTokenInterceptor
from common.server.tenants import Reload, TenantTokens


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, tokens: TenantTokens, role: str,
                 model_name: str) -> None:
        names = ["role", "model_name"]
        self._own = own = (role, model_name)
        self._calls = Counter("kvhandoff_api_calls", "Client API calls checked for a bearer "
                              "token, by the tenant they were admitted as ('unauthenticated': "
                              "refused)", [*names, "tenant"], registry=registry)
        self._reloads = Counter("kvhandoff_api_tokens_reloads", "Reloads of --api-tokens on "
                                "SIGHUP, by result (failed: the previous table stays)",
                                [*names, "result"], registry=registry)
        Gauge("kvhandoff_api_tenants", "Tenants in the token table in force", names,
              registry=registry).labels(*own).set_function(lambda: len(tokens.table.tenants))
        Gauge("kvhandoff_api_tokens", "Tokens in the token table in force", names,
              registry=registry).labels(*own).set_function(lambda: len(tokens.table.by_digest))

    def call(self, tenant: str) -> None:
        self._calls.labels(*self._own, tenant).inc()

    def reloaded(self, result: Reload) -> None:
        self._reloads.labels(*self._own, "ok" if result.ok else "failed").inc()


class TenantAuth:
    """The tokens in force, checked by `interceptor`, counted, reloaded by `reload()`."""

    def __init__(self, tokens: TenantTokens, registry: CollectorRegistry, role: str,
                 model_name: str, log) -> None:
        self.tokens = tokens
        self.log = log
        self.metrics = TenantMetrics(registry, tokens, role, model_name)
        self.interceptor = BearerTokenInterceptor(tokens, log, self.metrics.call)
        table = tokens.table
        log.info("api_tenants_loaded", source=str(tokens.path or "--api-token"),
                 tenants=sorted(table.tenants), tokens=len(table.by_digest))
        if tokens.path is not None and tokens.path.stat().st_mode & 0o077:
            log.warning("api_tokens_file_readable", path=str(tokens.path),
                        message="the tokens file is readable by its group or others; "
                                "chmod 600 it")

    def reload(self) -> Reload:
        """Reads the tokens file again (SIGHUP); a bad file keeps the table in force."""
        result = self.tokens.reload()
        self.metrics.reloaded(result)
        if result.ok:
            self.log.info("api_tokens_reloaded", path=str(self.tokens.path),
                          tenants=result.tenants, tokens=result.tokens,
                          added=list(result.added), removed=list(result.removed))
        else:
            self.log.error("api_tokens_reload_failed", message=f"{result.message}; keeping "
                           f"the previous table ({result.tenants} tenants, {result.tokens} "
                           "tokens)")
        return result

    def reload_on_sighup(self) -> None:
        """From now on SIGHUP reloads the file (a single --api-token has none to reload)."""
        if self.tokens.path is not None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
