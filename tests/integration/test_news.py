"""Worker news: a worker tells the frontends that did not send it of a long request at once,
instead of at their next heartbeat (gpu_workers.intake.Intake.news)."""

import asyncio
import dataclasses
import time

from frontend.dispatch import Dispatcher
from frontend.pool import WorkerPool
from shmserve import arena as shm
from shmserve import topology
from tests.integration.test_pool import encoded, ready_pool, run, start_worker


def test_a_long_request_is_news_to_the_other_frontends(tmp_path, cfg):
    """Frontends route by the queue each heard of at a worker's last heartbeat, up to
    workers.heartbeat_interval_s old: one sent a short request behind another frontend's
    bulk one, to wait seconds while the other worker was idle. A worker tells the other
    frontends at once of a request that is work of NEWS_S or more, and only of those."""
    from gpu_workers.intake import NEWS_S
    from tests.tinymodel import build_tiny_bert

    slow = build_tiny_bert(tmp_path / "models" / "slow", hidden=256, layers=4, heads=4,
                           max_positions=512)
    models = [dataclasses.replace(cfg.models[0], source=str(slow))]
    cfg = dataclasses.replace(
        cfg, models=models, model_roots=[str(slow.parent)],
        workers=dataclasses.replace(cfg.workers, heartbeat_interval_s=3.0,
                                    heartbeat_timeout_s=20.0))
    (cfg.run_dir / "config.json").write_text(cfg.to_json())
    worker = start_worker(cfg)
    arena = shm.Arena(shm.arena_name(topology.instance_id(cfg), "fe0"), 1 << 24)

    async def next_beat(link, after: float, within: float) -> bool:
        deadline = time.monotonic() + within
        while link.last_beat == after:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    async def scenario():
        sender = await ready_pool(cfg)
        other = WorkerPool(cfg, frontend=1)
        await other.start()
        try:
            link = other.links[0]
            await next_beat(link, 0.0, 30)
            assert link.beat.drain_rate > 0  # seeded at warm-up
            # Right after a periodic beat (the next is 3 s away): a short request is no news.
            await next_beat(link, link.last_beat, 10)
            seen = link.last_beat
            short = Dispatcher(cfg, sender, arena)
            await short.run("tiny", 256, encoded(1, 8), "short", time.time() + 10)
            assert not await next_beat(link, seen, 0.5)
            # A long one is: its queue reaches the other frontend well before the next beat.
            tokens = 16 * 500
            assert tokens / link.beat.drain_rate >= NEWS_S
            run = asyncio.ensure_future(Dispatcher(cfg, sender, arena).run(
                "tiny", 256, encoded(16, 500), "long", time.time() + 30))
            assert await next_beat(link, seen, 1.0), "no news of the long request"
            assert link.beat.queued > 0 and link.beat.ping_sent_at == 0.0
            seen = link.last_beat
            await run
            # the sender heard it before the reply: a serial client's next request is judged
            # on a queue without the request just answered (it was refused 429, the suite)
            assert sender.links[0].beat.queued == 0
            # Its end is news too: a serial client whose next request went to the other
            # frontend was refused 429 there, its queue still holding the previous one.
            assert await next_beat(link, seen, 0.5), "no news of the long request's end"
            assert link.beat.queued == 0 and link.beat.ping_sent_at == 0.0
        finally:
            await other.close()
            await sender.close()

    run(scenario, worker, arena)
