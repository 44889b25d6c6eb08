"""Which network addresses an image fetch may connect to: the classifier and the allow-list.

This module does no I/O (gateway/fetch.py resolves and connects). Two rules:
1. ``classify`` is a table lookup, first match wins, written from the IANA special-purpose
   registries rather than from ``ipaddress``'s ``is_private``/``is_global`` flags, whose
   meaning changed between Python patch releases (3.11.10, 3.12.4, 3.13) and which call
   224.0.0.0/4 "global". Anything not in the table is PUBLIC for IPv4; for IPv6 only
   2000::/3 (global unicast) can be PUBLIC, everything else is RESERVED.
2. IPv6 forms that carry an IPv4 address to an IPv4 host (IPv4-mapped ``::ffff:a.b.c.d``,
   NAT64 ``64:ff9b::/96``, 6to4 ``2002::/16``) are classified by the IPv4 address they
   carry, so ``::ffff:127.0.0.1`` is LOOPBACK, not an unremarkable IPv6 address.

An address is fetched when it is PUBLIC or when the operator's ``AllowList`` names it (by
CIDR) or names the URL's host.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass

__all__ = ["AddressKind", "AllowList", "IPAddress", "classify"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class AddressKind(enum.Enum):
    PUBLIC = "public"  # globally routable unicast: fetched without an allow-list entry
    UNSPECIFIED = "unspecified"  # 0.0.0.0 and ::; connecting to them reaches this host on Linux
    LOOPBACK = "loopback"  # 127.0.0.0/8 and ::1: this host's own services
    PRIVATE = "private"  # RFC 1918, shared CGNAT space, unique-local and site-local IPv6
    LINK_LOCAL = "link-local"  # 169.254.0.0/16 (cloud metadata at .169.254) and fe80::/10
    MULTICAST = "multicast"  # 224.0.0.0/4 and ff00::/8
    RESERVED = "reserved"  # documentation, benchmarking, protocol and future-use ranges


def _table(*rows: tuple[str, AddressKind]) -> tuple[tuple[IPNetwork, AddressKind], ...]:
    return tuple((ipaddress.ip_network(cidr), kind) for cidr, kind in rows)


K = AddressKind
_IPV4 = _table(
    ("0.0.0.0/32", K.UNSPECIFIED),
    ("0.0.0.0/8", K.RESERVED),  # "this network"; Linux routes 0.x.y.z to the local host
    ("127.0.0.0/8", K.LOOPBACK),
    ("10.0.0.0/8", K.PRIVATE),
    ("172.16.0.0/12", K.PRIVATE),
    ("192.168.0.0/16", K.PRIVATE),
    ("100.64.0.0/10", K.PRIVATE),  # shared address space (carrier-grade NAT), RFC 6598
    ("169.254.0.0/16", K.LINK_LOCAL),
    ("224.0.0.0/4", K.MULTICAST),
    ("192.0.0.0/24", K.RESERVED),  # IETF protocol assignments
    ("192.0.2.0/24", K.RESERVED),  # TEST-NET-1
    ("198.51.100.0/24", K.RESERVED),  # TEST-NET-2
    ("203.0.113.0/24", K.RESERVED),  # TEST-NET-3
    ("198.18.0.0/15", K.RESERVED),  # benchmarking
    ("192.88.99.0/24", K.RESERVED),  # deprecated 6to4 relay anycast
    ("240.0.0.0/4", K.RESERVED),  # future use, and 255.255.255.255 broadcast
)
_IPV6 = _table(
    ("::/128", K.UNSPECIFIED),
    ("::1/128", K.LOOPBACK),
    ("64:ff9b:1::/48", K.PRIVATE),  # local-use NAT64 (RFC 8215): translates into private space
    ("::/8", K.RESERVED),  # IPv4-compatible (deprecated) and SIIT forms; mapped ones are caught before
    ("100::/64", K.RESERVED),  # discard-only
    ("2001::/23", K.RESERVED),  # IETF protocol assignments: Teredo, benchmarking, ORCHID, ...
    ("2001:db8::/32", K.RESERVED),  # documentation
    ("3fff::/20", K.RESERVED),  # documentation (RFC 9637)
    ("fc00::/7", K.PRIVATE),  # unique local
    ("fe80::/10", K.LINK_LOCAL),
    ("fec0::/10", K.PRIVATE),  # site-local (deprecated)
    ("ff00::/8", K.MULTICAST),
)
_HOST_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
del K


def classify(address: IPAddress) -> AddressKind:
    """The kind of ``address``; see the module docstring for the rules."""
    if isinstance(address, ipaddress.IPv4Address):
        return _lookup(address, _IPV4, AddressKind.PUBLIC)
    carried = embedded_ipv4(address)
    if carried is not None:
        return classify(carried)
    if address.scope_id:  # fe80::1%eth0: a zone only makes sense on a local link
        return AddressKind.LINK_LOCAL
    default = AddressKind.PUBLIC if address in _GLOBAL_UNICAST_V6 else AddressKind.RESERVED
    return _lookup(address, _IPV6, default)


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 host an IPv6 address delivers to (mapped, NAT64 or 6to4), else None."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def _lookup(address: IPAddress, table: tuple[tuple[IPNetwork, AddressKind], ...], default: AddressKind) -> AddressKind:
    for network, kind in table:
        if address in network:
            return kind
    return default


@dataclass(frozen=True)
class AllowList:
    """Non-public addresses the operator lets image fetches reach.

    Entries are CIDRs (``10.1.0.0/16``, ``127.0.0.1``, ``fd00::/8``) or exact host names
    (``images.internal``; case-insensitive, no wildcards). A host-name entry trusts every
    address that name resolves to; the connection is still pinned to the checked address.
    """

    networks: tuple[IPNetwork, ...] = ()
    hostnames: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> AllowList:
        """Parse a comma-separated list. Raises ValueError naming a bad entry."""
        networks: list[IPNetwork] = []
        hostnames: set[str] = set()
        for raw in text.split(","):
            entry = raw.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            name = entry.rstrip(".").lower()
            labels = name.split(".")
            # An all-digit last label ("10.1") is an IP shorthand resolvers accept, not a name.
            if labels[-1].isdigit() or not all(_HOST_LABEL.fullmatch(label) for label in labels):
                raise ValueError(f"image URL allow-list entry {entry!r} is neither a CIDR nor a host name")
            hostnames.add(name)
        return cls(tuple(networks), frozenset(hostnames))

    def permits(self, host: str, address: IPAddress) -> bool:
        """True when ``host`` (as the URL names it, IDNA form) or ``address`` is listed.

        An IPv4-mapped address also matches an IPv4 entry: ``::ffff:127.0.0.1`` is the same
        socket as 127.0.0.1 on a dual-stack host.
        """
        if host.rstrip(".").lower() in self.hostnames:
            return True
        candidates: list[IPAddress] = [address]
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            candidates.append(address.ipv4_mapped)
        return any(c in net for c in candidates for net in self.networks if c.version == net.version)

    def __bool__(self) -> bool:
        return bool(self.networks or self.hostnames)
