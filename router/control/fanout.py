"""Control requests: fan one out to every instance of a role and combine the replies.

Weight updates and checksums must reach every denoise worker: a reply set is
only a success when all of them succeeded (router/control/versioned.py). No sockets
here: the dispatcher passes the function that sends one control request to one worker.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterable

from common.config.engine import WorkerSpec
from common.protocol.control import ControlReply, ControlRequest, kind_of
from common.protocol.messages import PROTOCOL_VERSION
from router.core.errors import EngineError
from router.link.join import Pending, PendingTable

Reply = ControlReply | EngineError
FROM_MEMORY = "<memory>"  # the source of an update a restarted worker cannot be given again
SendControl = Callable[[WorkerSpec, ControlRequest, dict | None], Awaitable[None]]
# Dispatcher.control(role, kind, **fields): every instance's reply to a ``kind`` message with ``fields``, by index.
ControlCall = Callable[..., Awaitable[list[Reply]]]


async def fan_out(workers: Iterable[WorkerSpec], kind: type[ControlRequest], fields: dict, pending: PendingTable,
                  send: SendControl, timeout_s: float, tensors: dict | None = None) -> list[Reply]:
    """Ask every worker at once (a ``kind`` message with ``fields``; each gets ``tensors`` too), then collect
    each answer (or its error, or a 504) in order. An answer of a kind that does not answer ``kind`` is a 502."""
    loop = asyncio.get_running_loop()
    waits = []
    for w in workers:
        rid = f"ctl-{uuid.uuid4().hex}"
        fut = loop.create_future()
        pending.add(rid, Pending(fut, None, target=(w.role, w.index)))
        await send(w, kind(v=PROTOCOL_VERSION, request_id=rid, **fields), tensors)
        waits.append((w, rid, fut))
    out: list[Reply] = []
    for w, rid, fut in waits:
        try:
            reply = await asyncio.wait_for(fut, timeout=timeout_s)
            out.append(reply if isinstance(reply, kind.replies) else EngineError(
                502, "bad_result", f"a {kind_of(reply)} does not answer {kind_of(kind)}", w.role, rid))
        except EngineError as e:
            out.append(e)
        except asyncio.TimeoutError:
            out.append(EngineError(504, "timeout", f"no answer to {kind_of(kind)}", w.role, rid))
        finally:
            pending.discard(rid)
    return out


def control_failure(replies: list[Reply], stage: str) -> EngineError | None:
    """``None`` when every worker succeeded. When all refused the request (4xx), their refusal;
    otherwise the workers may now disagree: 500 ``inconsistent_workers`` naming each failure."""
    errors = [r for r in replies if isinstance(r, EngineError)]
    if not errors:
        return None
    # Every worker refused (4xx), or every one failed the same way (a weight transfer that broke off: 504;
    # weights released: 503 sleeping): their answer, not a disagreement.
    if len(errors) == len(replies) and (all(400 <= e.status < 500 for e in errors)
                                         or len({(e.status, e.type) for e in errors}) == 1
                                         and errors[0].status in (503, 504)):
        e = errors[0]
        return EngineError(e.status, e.type, e.message, e.stage, "")
    detail = "; ".join(f"{e.stage}: {e.message}" for e in errors)
    return EngineError(500, "inconsistent_workers", f"{len(errors)}/{len(replies)} workers failed: {detail}",
                       stage, "")
