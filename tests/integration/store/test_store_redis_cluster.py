"""The Redis tier against a real 3-node Redis Cluster started on loopback by the test."""

from __future__ import annotations

import time

import pytest
import redis
from redis.cluster import RedisCluster

from lmcompact.store import ChunkCodec, StoreConfig, TieredStore, chunk_keys
from lmcompact.store.tiers.redis_tier import RedisTier
from lmcompact.store.tiers.redis_url import parse_cluster_url
from tests.redis_server import require_redis_server
from tests.support.redis_cluster import RedisClusterProcess, redis_cluster_fixture
from tests.support.redis_process import free_port
from tests.unit.store.store_helpers import make_chunk, make_namespace, same_chunk

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]

NS = make_namespace()
KEYS = chunk_keys(list(range(7000, 7000 + 256 * 24)), NS, 256)
redis_cluster = redis_cluster_fixture()


def cluster_tier(url: str, **kw) -> RedisTier:
    kw.setdefault("backoff_initial_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    kw.setdefault("socket_timeout_s", 1.0)
    return RedisTier(url, ChunkCodec(NS), **kw)


def raw_cluster(cluster: RedisClusterProcess) -> RedisCluster:
    return RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, require_full_coverage=False)


def test_round_trip_spreads_keys_and_batches_per_node(redis_cluster, monkeypatch):
    """One seed is enough (the others are discovered); 12 chunks land on all three nodes;
    a batch writes once per node and reads back every chunk bit-exact."""
    tier = cluster_tier(redis_cluster.seed_url(1))
    items = [(KEYS[i], make_chunk(i)) for i in range(12)]
    owners = {redis_cluster.node_of(tier.redis_key(k)) for k, _ in items}
    assert owners == {0, 1, 2}  # no hash tags: a request's chunks spread over the cluster
    assert tier.contains_many(KEYS[:12]) == [False] * 12  # connects to every node
    sends: list[int] = []
    original = redis.connection.Connection.send_packed_command

    def spy(self, command, check_health=True):
        sends.append(self.port)
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", spy)
    assert tier.put_many(items) == [True] * 12
    assert sorted(sends) == sorted(n.port for n in redis_cluster.nodes)
    sends.clear()
    got = tier.get_many(KEYS[:14])
    assert len(sends) == 3
    assert [g is not None for g in got] == [True] * 12 + [False] * 2
    assert all(same_chunk(got[i], make_chunk(i)) for i in range(12))
    assert tier.contains_many(KEYS[10:14]) == [True, True, False, False]
    m = tier.metrics()
    assert (m["hits"], m["misses"], m["puts"], m["errors"]) == (12, 2, 12, 0)
    assert m["healthy"] and m["nodes_down"] == []
    assert tier.delete(KEYS[0]) and not tier.contains(KEYS[0])
    tier.close()


def test_node_killed_gives_misses_and_skipped_saves_then_recovers(redis_cluster, caplog):
    tier = cluster_tier(redis_cluster.url)
    items = [(KEYS[i], make_chunk(i)) for i in range(12)]
    assert all(tier.put_many(items))
    owner = [redis_cluster.node_of(tier.redis_key(k)) for k, _ in items]
    redis_cluster.kill(1)
    lost = [o == 1 for o in owner]
    with caplog.at_level("WARNING"):
        for _ in range(3):
            got = tier.get_many(KEYS[:12])
            assert [g is None for g in got] == lost
            assert all(same_chunk(g, make_chunk(i)) for i, g in enumerate(got) if g is not None)
            assert tier.contains_many(KEYS[:12]) == [not x for x in lost]
            assert tier.put_many(items[:6]) == [not x for x in lost[:6]]
    assert not tier.healthy
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "unreachable" in warnings[0], warnings  # logged once
    m = tier.metrics()
    assert m["nodes_down"] == [f"127.0.0.1:{redis_cluster.nodes[1].port}"]
    assert m["misses"] == 3 * sum(lost) and m["put_failures"] == 3 * sum(lost[:6])
    assert m["errors"] >= 1
    redis_cluster.restart(1)  # rejoins with its slots, empty
    deadline = time.monotonic() + 10
    while not all(tier.put_many(items)):
        assert time.monotonic() < deadline, "tier did not recover"
        time.sleep(0.05)
    assert tier.healthy
    assert all(g is not None for g in tier.get_many(KEYS[:12]))
    tier.close()


def test_corrupted_and_foreign_entries_are_refused_and_deleted(redis_cluster):
    tier = cluster_tier(redis_cluster.url)
    assert tier.put_many([(KEYS[0], make_chunk(0)), (KEYS[1], make_chunk(1))]) == [True] * 2
    raw = raw_cluster(redis_cluster)
    damaged = tier.redis_key(KEYS[0])
    value = raw.get(damaged)
    raw.set(damaged, value[:400] + bytes([value[400] ^ 0x10]) + value[401:])
    foreign = ChunkCodec(make_namespace(model_id="other")).encode(make_chunk(1)).tobytes()
    raw.set(tier.redis_key(KEYS[1]), foreign)
    assert tier.get_many(KEYS[:2]) == [None, None]
    m = tier.metrics()
    assert (m["rejected"], m["hits"], m["misses"]) == (2, 0, 2)
    assert tier.codec.metrics()["checksum_mismatch"] == 1
    assert tier.codec.metrics()["foreign_namespace"] == 1
    assert raw.exists(damaged) == 0 and raw.exists(tier.redis_key(KEYS[1])) == 0
    assert tier.put(KEYS[0], make_chunk(0)) and same_chunk(tier.get(KEYS[0]), make_chunk(0))
    raw.close()
    tier.close()


def test_store_over_cluster_truncates_prefix_at_a_dead_node(redis_cluster):
    """A store with only the cluster tier: after a node dies, the stored prefix ends at
    the first chunk on that node (the engine recomputes from there)."""
    cfg = StoreConfig(
        cpu_capacity_bytes=None,
        redis_url=redis_cluster.url,
        redis_backoff_initial_s=0.05,
        redis_backoff_max_s=0.1,
    )
    with TieredStore(NS, cfg) as store:
        assert all(store.put_many([(KEYS[i], make_chunk(i)) for i in range(8)]))
        assert store.flush(10)
        assert store.lookup_prefix(KEYS[:9]) == 8
        tier = store.tier("redis")
        assert isinstance(tier, RedisTier)
        owner = [redis_cluster.node_of(tier.redis_key(k)) for k in KEYS[:8]]
        victim = owner[2]
        redis_cluster.kill(victim)
        assert store.lookup_prefix(KEYS[:8]) == owner.index(victim)
        assert store.metrics()["redis"]["healthy"] is False


def test_unreachable_cluster_at_start_never_raises():
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    tier = cluster_tier(url)
    assert not tier.healthy
    assert tier.get(KEYS[0]) is None and tier.put(KEYS[0], make_chunk(0)) is False
    assert tier.contains_many(KEYS[:3]) == [False] * 3
    assert tier.metrics()["errors"] >= 1


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",
        "redis+cluster://127.0.0.1",
        "redis+cluster://127.0.0.1:7000/2",
        "cluster://127.0.0.1:7000",
    ],
)
def test_bad_cluster_urls_are_refused_where_they_enter(url):
    with pytest.raises(ValueError, match=r"(?i)redis"):
        StoreConfig(cpu_capacity_bytes=None, redis_url=url)


def test_cluster_url_parsing():
    address = parse_cluster_url("rediss+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2:7001/0")
    assert address.seeds == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert (address.username, address.password, address.tls) == ("u", "p@ss", True)
    assert "p@ss" not in address.redacted()


def test_a_moved_slot_is_followed(redis_cluster):
    """A slot moved to another node (as in resharding) answers MOVED: the tier reloads the
    slot map and sends the command again to the new owner, in the same call."""
    tier = cluster_tier(redis_cluster.url)
    assert tier.put(KEYS[0], make_chunk(0))
    rkey = tier.redis_key(KEYS[0])
    source = redis_cluster.node_of(rkey)
    target = (source + 1) % 3
    nodes = [redis.Redis(port=n.port) for n in redis_cluster.nodes]
    ids = [c.cluster("myid") for c in nodes]
    ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
    slot = int(nodes[0].cluster("keyslot", rkey))
    nodes[target].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[source])
    nodes[source].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target])
    port = redis_cluster.nodes[target].port
    nodes[source].execute_command("MIGRATE", "127.0.0.1", port, "", 0, 5000, "KEYS", rkey)
    for c in nodes:
        c.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target])
    assert redis_cluster.node_of(rkey) == target
    got = tier.get(KEYS[0])  # the stale map sends it to the source first
    assert got is not None and same_chunk(got, make_chunk(0))
    assert tier.metrics()["errors"] == 0 and tier.healthy
    assert tier.put(KEYS[0], make_chunk(0))  # the new map routes directly
    tier.close()


def test_bench_store_on_a_private_cluster(tmp_path):
    """``bench store --redis-cluster 3`` starts its own cluster and compares the tier with
    redis-py's RedisCluster pipeline on it."""
    import argparse
    import json

    from lmcompact.bench import store as bench_store

    parser = argparse.ArgumentParser()
    bench_store.add_arguments(parser)
    argv = ["--layers", "2", "--kv-heads", "2", "--chunk-tokens", "64", "--chunks", "6",
            "--iters", "1", "--repeats", "2", "--budgets", "0.5", "--redis-cluster", "3",
            "--json", str(tmp_path / "s.json")]  # fmt: skip
    assert bench_store.run(parser.parse_args(argv)) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["redis"].startswith("redis+cluster://127.0.0.1:")
    row = result["rows"][0]
    assert row["redis_vs_raw"] > 0 and row["raw_get_gbps"] > 0 and row["redis_put_gbps"] > 0


def test_full_cluster_evicts_or_refuses_without_errors_for_requests():
    """Nodes under maxmemory: with LRU eviction old chunks vanish (misses, the newest stay);
    without eviction Redis refuses SETs (OOM): failed puts, counted, never a raise."""
    require_redis_server()
    lru = ["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"]
    with RedisClusterProcess(extra_args=lru) as cluster:
        tier = cluster_tier(cluster.url)
        for i in range(24):  # ~0.4 MB each, ~10 MB in all over 9 MB of maxmemory
            assert tier.put(KEYS[i], make_chunk(i, kept=128, dim=64))
        present = tier.contains_many(KEYS[:24])
        assert present[-1] and not all(present)
        got = tier.get_many(KEYS[:24])
        assert [g is not None for g in got] == present
        assert tier.healthy and tier.metrics()["errors"] == 0
    refuse = ["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]
    with RedisClusterProcess(extra_args=refuse) as cluster:
        tier = cluster_tier(cluster.url)
        ok = tier.put_many([(KEYS[i], make_chunk(i, kept=128, dim=64)) for i in range(24)])
        assert any(ok) and not all(ok)
        assert tier.healthy and tier.metrics()["errors"] == ok.count(False)
        assert tier.contains_many(KEYS[:24]) == ok


def test_ttl_on_a_cluster(redis_cluster):
    tier = cluster_tier(redis_cluster.url, ttl_s=2.0)  # long enough for a loaded host
    assert tier.put_many([(KEYS[i], make_chunk(i)) for i in range(6)]) == [True] * 6
    raw = raw_cluster(redis_cluster)
    assert all(0 < raw.pttl(tier.redis_key(KEYS[i])) <= 2000 for i in range(6))
    raw.close()
    time.sleep(2.1)
    assert tier.get_many(KEYS[:6]) == [None] * 6


def test_failover_to_a_replica_serves_the_chunks_again():
    """3 primaries with a replica each: a primary killed is misses for its keys until its
    replica is promoted (cluster-node-timeout 2 s); the tier then reloads the slot map and
    reads the replicated chunks from the new primary, and forgets the dead node."""
    require_redis_server()
    with RedisClusterProcess(replicas=1) as cluster:
        tier = cluster_tier(cluster.url)
        items = [(KEYS[i], make_chunk(i)) for i in range(12)]
        assert all(tier.put_many(items))
        owner = [cluster.node_of(tier.redis_key(k)) for k, _ in items]
        for index in set(owner):  # every write reached a replica
            assert redis.Redis(port=cluster.nodes[index].port).execute_command("WAIT", 1, 5000)
        victim = owner[0]
        cluster.kill(victim)
        assert tier.get(KEYS[0]) is None  # down, not yet failed over
        deadline = time.monotonic() + 30
        while tier.get(KEYS[0]) is None:
            assert time.monotonic() < deadline, "no failover seen"
            time.sleep(0.2)
        # The node node_of asks may learn of the promotion by gossip after the tier did.
        while cluster.node_of(tier.redis_key(KEYS[0])) == victim:
            assert time.monotonic() < deadline, "the slot map never moved off the dead node"
            time.sleep(0.2)
        got = tier.get_many([k for k, _ in items])
        assert all(g is not None and same_chunk(g, c) for g, (_, c) in zip(got, items, strict=True))
        assert tier.healthy and tier.metrics()["nodes_down"] == []
        tier.close()


def test_a_node_whose_port_was_taken_starts_on_fresh_ports():
    """A port picked free can be taken before the node starts (CI saw a node exit at once):
    the server's own reason reaches the error, and a cluster node picks new ports."""
    import socket

    from tests.redis_server import require_redis_server
    from tests.support.redis_process import RedisProcess

    require_redis_server()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        lone = RedisProcess(port=taken)
        with pytest.raises(RuntimeError, match=r"(?i)address already in use"):
            lone.start()
        lone.stop()
        cluster = RedisClusterProcess()
        cluster.nodes[0].port = taken
        with cluster:
            assert cluster.nodes[0].port != taken
            tier = cluster_tier(cluster.url)
            assert tier.put(KEYS[0], make_chunk(0)) and tier.get(KEYS[0]) is not None
            tier.close()
