"""Pipelined Redis ``SET`` of values given as several buffers, without joining them.

redis-py packs each argument of a command from one buffer, so a value made of a frame head
and views of tensors (:class:`lmcompact.store.codec.EncodedValue`) would have to be joined
first: one more copy of every payload byte. A Redis request is an array of bulk strings,
each announced by its length, so this module frames ``SET`` itself (RESP, the same for
protocol 2 and 3)::

    *3 | *5                         number of arguments
    $3 SET                          the command
    $<len(key)> <key>
    $<nbytes>   <part 0><part 1>... the value, written buffer after buffer
    [$2 PX $<len> <ttl ms>]         optional expiry

and sends a whole batch through one pooled connection of the client, then reads one reply
per command: one round trip per batch, as redis-py's non-transactional pipeline does. Small
pieces are coalesced so the socket sees few writes; large ones are written from the caller's
memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.connection import Connection

Buffer = bytes | bytearray | memoryview

Command = tuple[bytes, Sequence[Buffer]]
"""A command as its key (which routes it on a cluster) and its packed RESP buffers."""

COALESCE_BYTES = 16 << 10
"""Buffers shorter than this are joined with their neighbours before writing."""


def pack_set(key: bytes, parts: Sequence[Buffer], px: int | None = None) -> list[Buffer]:
    """The RESP frame of ``SET key <parts joined> [PX px]`` as a list of buffers.

    Args:
        key: the Redis key.
        parts: the value's buffers, in order (not copied).
        px: expiry in milliseconds; None for none.
    """
    nbytes = sum(memoryview(p).nbytes for p in parts)
    nargs = 3 if px is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (nargs, len(key), key, nbytes)
    tail = b"\r\n"
    if px is not None:
        ttl = b"%d" % px
        tail += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl)
    return [head, *parts, tail]


def coalesce(buffers: Sequence[Buffer], cutoff: int = COALESCE_BYTES) -> list[Buffer]:
    """Join runs of buffers shorter than ``cutoff``; longer ones pass through uncopied."""
    out: list[Buffer] = []
    small: list[Buffer] = []
    for b in buffers:
        if memoryview(b).nbytes < cutoff:
            small.append(b)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(b)
    if small:
        out.append(b"".join(small))
    return out


def pack_command(*args: bytes) -> bytes:
    """The RESP frame of a command of small arguments (``GET key``, ``EXISTS key``, ...)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


def send_packed(conn: Connection, packed: Sequence[Buffer]) -> None:
    """Write a batch of packed commands on ``conn`` (small buffers coalesced)."""
    conn.send_packed_command(coalesce(packed))


def read_replies(conn: Connection, num_replies: int) -> list[Any]:
    """Read ``num_replies`` replies from ``conn``; an error reply comes back as its
    :class:`redis.exceptions.ResponseError` instance (the replies after it are still read)."""
    replies: list[Any] = []
    for _ in range(num_replies):
        try:
            replies.append(conn.read_response())
        except redis.exceptions.ResponseError as exc:
            replies.append(exc)
    return replies


def take_connection(client: redis.Redis) -> Connection:
    """A connection from ``client``'s pool (give it back with ``pool.release``)."""
    pool = client.connection_pool
    try:
        return pool.get_connection()  # type: ignore[no-any-return]
    except TypeError:  # redis-py < 5.1 wants a command name
        return pool.get_connection("SET")  # type: ignore[no-any-return]


def execute_packed(client: redis.Redis, packed: Sequence[Buffer], num_replies: int) -> list[Any]:
    """Send ``packed`` (``num_replies`` commands) on one connection; read every reply.

    Returns:
        One reply per command; an error reply comes back as its
        :class:`redis.exceptions.ResponseError` instance (the others are still read).

    Raises:
        redis.exceptions.ConnectionError, TimeoutError: the connection failed; it is
            closed, so no half-read reply is left on it for the next user.
    """
    conn = take_connection(client)
    try:
        send_packed(conn, packed)
        return read_replies(conn, num_replies)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        client.connection_pool.release(conn)
