"""Who a request comes from: the identity the per-client session cap counts.

A client is its network address. Behind a reverse proxy every connection comes from the proxy's
address, so the proxy's `X-Forwarded-For` names the real client; but any client can send that
header itself, so it is believed only from a proxy the operator names (ENV_TRUSTED_PROXIES).

Guarantees:
- With no trusted proxies (the default) the identity is the TCP peer address; no header a client
  sends changes it (`python -m env_space` runs uvicorn with its own proxy-header rewriting off,
  which would otherwise believe `X-Forwarded-For` from loopback).
- With trusted proxies, `X-Forwarded-For` is read from the right (the entry the nearest proxy
  appended) and each entry is believed only while the hop that wrote it is trusted: the identity
  is the first address, walking from the peer towards the client, that is not a named proxy.
  Entries a client put in front of its own request are never reached, so forging them changes
  nothing. `*` trusts whatever peer connects (a host reachable only through its proxy, such as a
  Space) for that one hop.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from env_space.errors import ConfigError

_Net = ipaddress.IPv4Network | ipaddress.IPv6Network
_MAX_ID = 64  # an identity is a dict key: bound what a proxy's header can make it


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class ClientIdentity:
    """The operator's trusted proxies (addresses or networks; `any_peer` for `*`)."""

    networks: tuple[_Net, ...] = ()
    any_peer: bool = False

    @classmethod
    def parse(cls, spec: str) -> ClientIdentity:
        """`spec`: comma-separated addresses or CIDR networks, or `*`; empty: trust none.
        Raises `ConfigError` naming the entry that is neither."""
        nets: list[_Net] = []
        any_peer = False
        for raw in (x.strip() for x in spec.split(",")):
            if not raw:
                continue
            if raw == "*":
                any_peer = True
                continue
            try:
                nets.append(ipaddress.ip_network(raw, strict=False))
            except ValueError:
                raise ConfigError(f"ENV_TRUSTED_PROXIES entry {raw!r} is not an IP address or network",
                                  hint="list the reverse proxies' addresses, e.g. 10.0.0.5,10.1.0.0/16, "
                                  "or * when every connection comes through the proxy") from None
        return cls(tuple(nets), any_peer)

    @property
    def trusts_any(self) -> bool:
        return self.any_peer or bool(self.networks)

    def _named(self, addr: str) -> bool:
        ip = _ip(addr)
        return ip is not None and any(ip in net for net in self.networks)

    def of(self, peer: str, forwarded_for: Iterable[str]) -> str:
        """The client behind a connection from `peer` whose `X-Forwarded-For` header values
        (every occurrence, in order) are `forwarded_for`."""
        if not self.trusts_any or not (self.any_peer or self._named(peer)):
            return peer
        hops = [h.strip() for value in forwarded_for for h in value.split(",") if h.strip()]
        client = peer
        while hops:
            client = hops.pop()  # the entry the trusted hop appended
            if not self._named(client):
                break
        ip = _ip(client)
        return str(ip) if ip is not None else client[:_MAX_ID]
