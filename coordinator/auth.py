"""Tenants: who is calling, from the bearer token, never from a request field.

The tenants file (JSON) maps bearer tokens to tenants and tenants to quotas:

    {"tokens": {"s3cret-token": "acme"}, "quotas": {"acme": 4096}}

With no tokens configured, authentication is off and every caller is the
tenant "default" (a local cluster). TLS is the channel's business; this seam
only reads the `authorization: Bearer <token>` metadata.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..protos.errors import InvalidArgument, Unauthenticated

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenants:
    tokens: Mapping[str, str] = field(default_factory=dict)  # bearer token -> tenant
    quotas: Mapping[str, int] = field(default_factory=dict)  # tenant -> max blocks

    @classmethod
    def load(cls, path: str | Path | None) -> Tenants:
        if not path:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"tenants file {path}: {exc}") from None
        tokens, quotas = raw.get("tokens", {}), raw.get("quotas", {})
        if not isinstance(tokens, dict) or not all(isinstance(v, str) and v for v in tokens.values()):
            raise InvalidArgument(f"tenants file {path}: 'tokens' must map token strings to tenant names")
        if not isinstance(quotas, dict) or not all(isinstance(v, int) and v >= 0 for v in quotas.values()):
            raise InvalidArgument(f"tenants file {path}: 'quotas' must map tenants to block counts >= 0")
        return cls(dict(tokens), dict(quotas))

    @property
    def is_enabled(self) -> bool:
        return bool(self.tokens)

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The calling tenant; Unauthenticated when auth is on and the token is missing or unknown."""
        if not self.is_enabled:
            return DEFAULT_TENANT
        for key, value in metadata or ():
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                scheme, _, token = text.partition(" ")
                if scheme.lower() == "bearer" and token in self.tokens:
                    return self.tokens[token]
                raise Unauthenticated("unknown bearer token")
        raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
