"""Redis URLs the store takes, parsed without importing redis-py (an optional extra).

One server: ``redis://[[user]:password@]host:port/db`` (``rediss://`` for TLS), parsed by
redis-py itself. A cluster: ``redis+cluster://[[user]:password@]host:port[,host:port...]``
(``rediss+cluster://`` for TLS), one or more seed nodes, parsed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
REDIS_SCHEMES = ("redis", "rediss", *CLUSTER_SCHEMES)
"""URL schemes of the Redis tier: one server (plain, TLS) or a cluster (plain, TLS)."""


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def check_redis_url(url: str, name: str = "redis_url") -> None:
    """Raise ValueError naming ``name`` when ``url`` is not a URL the Redis tier takes."""
    if urlsplit(url).scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"{name} must start with one of {[s + '://' for s in REDIS_SCHEMES]}, got {url!r}"
        )
    if is_cluster_url(url):
        parse_cluster_url(url)


@dataclass(frozen=True)
class ClusterAddress:
    """A parsed cluster URL: seed nodes and credentials."""

    seeds: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    tls: bool

    def redacted(self) -> str:
        auth = "***@" if self.password else ""
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://{auth}" + ",".join(f"{h}:{p}" for h, p in self.seeds)


def parse_cluster_url(url: str) -> ClusterAddress:
    """Parse ``redis+cluster://[[user]:password@]host:port[,host:port...][/0]``.

    Raises:
        ValueError: another scheme, no seed, a seed without a port, or a database other
            than 0 (a cluster has only database 0).
    """
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"a cluster url starts with redis+cluster://, got {url!r}")
    auth, _, hosts = parts.netloc.rpartition("@")
    user, _, password = auth.partition(":")
    seeds = []
    for seed in filter(None, hosts.split(",")):
        host, _, port = seed.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"cluster seed must be host:port, got {seed!r} in {url!r}")
        seeds.append((host.strip("[]"), int(port)))
    if not seeds:
        raise ValueError(f"a cluster url names at least one host:port, got {url!r}")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis cluster has only database 0, got path {parts.path!r}")
    return ClusterAddress(
        seeds=tuple(seeds),
        username=unquote(user) or None,
        password=unquote(password) or None,
        tls=parts.scheme == "rediss+cluster",
    )
