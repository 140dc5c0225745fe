"""Who may push: loopback only by default, a bearer token or an allow-list of networks when configured.

Pushing can inject or delete series, so an open network port must not mean an open push API.
"""

import ipaddress
from dataclasses import dataclass

from stepscope.exporter.ingest.errors import Rejected
from stepscope.exporter.ingest.tokens import IngestTokens

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class AccessPolicy:
    """token set: every client needs `Authorization: Bearer <token>` with one of its tokens (and, with
    `allow`, an address in it), except clients in `without_token`. No token: loopback clients and clients
    in `allow` or `without_token` may push."""

    token: IngestTokens | None = None
    allow: tuple[Network, ...] = ()
    without_token: tuple[Network, ...] = ()

    def check(self, client_ip: str, authorization: str | None) -> None:
        """Returns when the client may push; raises Rejected (401 or 403) otherwise."""
        address = _address(client_ip)
        client = str(address) if address is not None else client_ip
        allowed = address is not None and any(address in network for network in self.allow)
        if address is not None and any(address in network for network in self.without_token):
            return
        if self.token is not None:
            if self.allow and not allowed:
                raise Rejected(
                    403, "forbidden",
                    f"pushes from {client} are not allowed: the address is outside --ingest-allow",
                )
            if not _bearer_matches(authorization, self.token):
                raise Rejected(
                    401, "unauthorized",
                    "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the token "
                    "from the exporter's --ingest-token-file (or add this client to --ingest-allow-without-token)",
                )
            return
        if allowed or (address is not None and address.is_loopback):
            return
        example = f"{client}/{address.max_prefixlen}" if address is not None else "10.0.0.0/8"
        who = "loopback clients and --ingest-allow networks" if self.allow else "loopback clients"
        raise Rejected(
            403, "forbidden",
            f"pushes from {client} are not allowed: only {who} may push without a token; start the "
            "exporter with --ingest-token-file FILE (clients then send 'Authorization: Bearer <token>') "
            f"or add this client to --ingest-allow (e.g. {example})",
        )


def _address(client_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(client_ip.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack listener reports IPv4 clients as ::ffff:a.b.c.d
    return address


def _bearer_matches(authorization: str | None, tokens: IngestTokens) -> bool:
    scheme, _, presented = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and tokens.matches(presented.strip())
