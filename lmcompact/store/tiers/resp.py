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

Buffer = bytes | bytearray | memoryview

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


def execute_packed(client: redis.Redis, packed: Sequence[Buffer], num_replies: int) -> list[Any]:
    """Send ``packed`` (``num_replies`` commands) on one connection; read every reply.

    Returns:
        One reply per command; an error reply comes back as its
        :class:`redis.exceptions.ResponseError` instance (the others are still read).

    Raises:
        redis.exceptions.ConnectionError, TimeoutError: the connection failed; it is
            closed, so no half-read reply is left on it for the next user.
    """
    pool = client.connection_pool
    try:
        conn = pool.get_connection()
    except TypeError:  # redis-py < 5.1 wants a command name
        conn = pool.get_connection("SET")
    try:
        conn.send_packed_command(coalesce(packed))
        replies: list[Any] = []
        for _ in range(num_replies):
            try:
                replies.append(conn.read_response())
            except redis.exceptions.ResponseError as exc:
                replies.append(exc)
        return replies
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
