"""The image address policy: ImagePolicy, blocked networks, allow lists, address vetting."""

from __future__ import annotations

import functools
import ipaddress
import math
from dataclasses import dataclass

from llava.core.errors import ImageForbidden, InvalidRequest
from llava.images.refs import INLINE_HINT

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class ImagePolicy:
    """Limits and address rules for loading images named in requests."""

    allow_http: bool = False
    allow_hosts: tuple[str, ...] = ()
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    total_timeout_s: float = 20.0
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_redirects: int = 3
    # s3:// references the endpoint's role may read: "bucket" or "bucket/prefix/" entries.
    # Empty (the default): none, so a caller cannot make the endpoint read what its role can.
    s3_allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.allow_hosts, str):
            raise InvalidRequest(
                "ImagePolicy.allow_hosts must be a tuple of host names or CIDRs, not one "
                f"string; write ({self.allow_hosts!r},)",
                field="allow_hosts",
            )
        # Accept any iterable (e.g. a list from YAML) but store a tuple so policies hash.
        object.__setattr__(self, "allow_hosts", tuple(self.allow_hosts))
        _allow_list(self.allow_hosts)
        if isinstance(self.s3_allow, str):
            raise InvalidRequest(
                f"ImagePolicy.s3_allow must be a tuple of buckets or bucket/prefix entries, not "
                f"one string; write ({self.s3_allow!r},)",
                field="s3_allow",
            )
        object.__setattr__(self, "s3_allow", tuple(e.strip() for e in self.s3_allow if e.strip()))
        for name in ("connect_timeout_s", "read_timeout_s", "total_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidRequest(f"ImagePolicy.{name} must be a positive number of seconds")
        for name, low in (("max_bytes", 1), ("max_pixels", 1), ("max_redirects", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise InvalidRequest(f"ImagePolicy.{name} must be an integer >= {low}")

    @property
    def allow_s3(self) -> bool:
        """Whether any s3:// reference may be read."""
        return bool(self.s3_allow)

    def s3_allowed(self, bucket: str, key: str) -> bool:
        """Tell whether s3://bucket/key lies under an allowed bucket or prefix."""
        path = f"{bucket}/{key}"
        return any(
            path.startswith(entry if "/" in entry else entry + "/") for entry in self.s3_allow
        )

    @property
    def allowed_schemes(self) -> frozenset[str]:
        """Return the reference schemes this policy accepts ("base64" meaning bare base64)."""
        schemes = {"https", "data", "base64"}
        if self.allow_http:
            schemes.add("http")
        if self.allow_s3:
            schemes.add("s3")
        return frozenset(schemes)


# --- address policy -----------------------------------------------------------------------

_METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS/GCP/Azure instance metadata
        "169.254.170.2",  # ECS task metadata and credentials
        "169.254.170.23",  # EKS pod identity agent
        "fd00:ec2::254",  # AWS instance metadata over IPv6
        "fd00:ec2::23",  # EKS pod identity agent over IPv6
        "100.100.100.200",  # Alibaba Cloud metadata
        "192.0.0.192",  # Oracle Cloud metadata
    )
)

# Spelled out rather than left to `ipaddress` flags, whose meaning shifts between Python
# versions (e.g. 192.0.0.0/24 and multicast count as "global" on some of them).
_BLOCKED_NETWORKS: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), reason)
    for net, reason in (
        ("0.0.0.0/8", "unspecified"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "shared (carrier-grade NAT)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "reserved"),
        ("192.0.2.0/24", "reserved"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "reserved"),
        ("198.51.100.0/24", "reserved"),
        ("203.0.113.0/24", "reserved"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("64:ff9b:1::/48", "private"),
        ("100::/64", "reserved"),
        ("2001::/23", "reserved"),
        ("2001:db8::/32", "reserved"),
        ("fc00::/7", "private"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local"),
        ("ff00::/8", "multicast"),
    )
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPAT = ipaddress.ip_network("::/96")


@dataclass(frozen=True)
class _AllowList:
    hosts: frozenset[str]
    networks: tuple[IPNetwork, ...]


@functools.lru_cache(maxsize=64)
def _allow_list(entries: tuple[str, ...]) -> _AllowList:
    """Split allow_hosts into host names and networks, refusing entries that are neither."""
    hosts: set[str] = set()
    networks: list[IPNetwork] = []
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise InvalidRequest(
                f"ImagePolicy.allow_hosts entry {entry!r} must be a host name or CIDR",
                field="allow_hosts",
            )
        text = entry.strip()
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
            continue
        except ValueError:
            pass
        if "/" in text or ":" in text or "@" in text:
            raise InvalidRequest(
                f"ImagePolicy.allow_hosts entry {entry!r} is neither a host name nor a CIDR; "
                "write e.g. 'images.example.com' or '10.0.0.0/8'",
                field="allow_hosts",
            )
        hosts.add(_normalize_host(text))
    return _AllowList(frozenset(hosts), tuple(networks))


def _normalize_host(host: str) -> str:
    """Lower-case a host and drop IPv6 brackets and a trailing root dot."""
    return host.strip().strip("[]").rstrip(".").lower()


def parse_ip(ip: str) -> IPAddress | None:
    """Parse an address, dropping any IPv6 zone id; None if it is not an IP address."""
    try:
        return ipaddress.ip_address(ip.strip().strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, bool] | None:
    """Return the IPv4 address an IPv6 form carries, and whether it *is* that IPv4 host."""
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped, True
    packed_tail = ipaddress.IPv4Address(addr.packed[-4:])
    if addr in _NAT64:
        return packed_tail, True
    if addr in _IPV4_COMPAT and int(addr) > 1:
        return packed_tail, True
    if addr.sixtofour is not None:
        return addr.sixtofour, False
    if addr.teredo is not None:
        return addr.teredo[1], False
    return None


def _blocked_reason(addr: IPAddress) -> str | None:
    """Name the class of a non-public address, or None for a public one."""
    if isinstance(addr, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(addr)
        if embedded is not None:
            v4, same_host = embedded
            reason = _blocked_reason(v4)
            if reason is not None or same_host:
                # A mapped/NAT64 form reaches exactly that IPv4 host: judge it as one.
                return None if reason is None else f"{reason} (embedded in IPv6)"
            # 6to4 and Teredo reach a public host only through a relay; IANA lists neither as
            # globally reachable, and Python's `is_global` says so from 3.12.4/3.13 on but not
            # before: refuse them on every Python the images run.
            return "tunnelled (6to4 or Teredo)"
    if addr in _METADATA:
        return "cloud metadata"
    for network, reason in _BLOCKED_NETWORKS:
        if addr.version == network.version and addr in network:
            return reason
    flags = (
        ("unspecified", addr.is_unspecified),
        ("loopback", addr.is_loopback),
        ("link-local", addr.is_link_local),
        ("multicast", addr.is_multicast),
        ("private", addr.is_private),
        ("reserved", addr.is_reserved),
        ("non-public", not addr.is_global),
    )
    return next((reason for reason, hit in flags if hit), None)


def _address_allow_listed(addr: IPAddress, allow: _AllowList) -> bool:
    """Tell whether an address (or the IPv4 host its IPv6 form maps to) is allow-listed."""
    candidates: list[IPAddress] = [addr]
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        candidates.append(addr.ipv4_mapped)
    return any(c.version == net.version and c in net for c in candidates for net in allow.networks)


def vet_address(ip: str, policy: ImagePolicy, host: str | None) -> None:
    """Raise ImageForbidden unless `ip` is public or allow-listed; name `host` if given."""
    addr = parse_ip(ip)
    where = f"image host {host!r}" if host else "address"
    if addr is None:
        raise ImageForbidden(f"{where} did not resolve to an IP address ({ip!r}); {INLINE_HINT}")
    if _address_allow_listed(addr, _allow_list(policy.allow_hosts)):
        return
    reason = _blocked_reason(addr)
    if reason is not None:
        # The address itself stays out of the message: echoing internal DNS answers back
        # to a client would turn this check into a network-mapping oracle.
        target = f"{where} resolves to a" if host else "address is a"
        raise ImageForbidden(
            f"{target} {reason} address, which image URLs may not reach; use a publicly "
            f"reachable URL or {INLINE_HINT}"
        )


def check_address(ip: str, policy: ImagePolicy) -> None:
    """Raise ImageForbidden unless the image fetcher may connect to `ip` under `policy`."""
    vet_address(ip, policy, None)


def host_allow_listed(host: str, policy: ImagePolicy) -> bool:
    """Tell whether a URL host name is allow-listed by name."""
    return _normalize_host(host) in _allow_list(policy.allow_hosts).hosts
