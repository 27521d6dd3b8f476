"""`rollout reward-worker --allow` against jobs an attacker with Redis access would write
(issue 26): rq 3 webhooks and dependencies are refused, no webhook is ever sent (not even
for a refused job), and the worker refuses an rq major it was not checked against.
A real `rollout reward-worker` process, a real Redis, a real HTTP server for the webhooks."""
from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import rq
from rq import Queue
from rq.registry import FailedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.webhook import Webhook

from tests.test_reward_queue import conn, make_group, redis_server, reward_worker_process  # noqa: F401 (fixtures)
from workers.reward_queue import DEFAULT_QUEUE, run_reward_worker, score_group_job


@pytest.fixture
def webhook_sink():
    """An HTTP server recording every request it gets."""
    calls: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            calls.append(f"GET {self.path}")
            self.send_response(200)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", calls
    server.shutdown()
    thread.join(10)


def test_webhooks_and_dependencies_are_refused_and_no_webhook_is_sent(conn, redis_server, webhook_sink):
    url, calls = webhook_sink
    queue = Queue(DEFAULT_QUEUE, connection=conn, serializer=JSONSerializer)
    samples = [s.to_dict() for s in make_group([r"\boxed{42}"])]
    hooks = [Webhook(f"{url}/finished", "finished", method="POST", headers={"X-Steal": "1"}),
             Webhook(f"{url}/failed", "failed")]
    first = queue.enqueue(score_group_job, "math_boxed", False, {}, samples)
    refused = {
        "webhooks": queue.enqueue(score_group_job, "math_boxed", False, {}, samples, webhooks=hooks),
        "webhooks on a refused job": queue.enqueue("tests.test_reward_queue.leave_mark", webhooks=hooks),
        "a dependency": queue.enqueue(score_group_job, "math_boxed", False, {}, samples, depends_on=first),
    }

    async def run() -> None:
        for _ in range(2):  # the dependent job is enqueued once its dependency finished
            proc = await reward_worker_process(redis_server, "math_boxed")
            output, _ = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, output.decode()

    asyncio.run(run())
    assert calls == []  # nothing was sent anywhere
    assert Result.fetch_latest(first, serializer=JSONSerializer).return_value == [1.0]
    failed = FailedJobRegistry(DEFAULT_QUEUE, connection=conn, serializer=JSONSerializer).get_job_ids()
    reasons = {"webhooks": "job webhooks are not sent here (2 given)",
               "webhooks on a refused job": "runs only workers.reward_queue.score_group_job",
               "a dependency": "a scoring job has no dependencies (1 given)"}
    for what, job in refused.items():
        assert job.id in failed, what
        text = Result.fetch_latest(job, serializer=JSONSerializer).exc_string
        assert f"JobRefused: refused job {job.id}: " in text and reasons[what] in text, (what, text)


def test_a_reward_worker_refuses_an_rq_major_it_was_not_checked_against(conn, monkeypatch):
    monkeypatch.setattr(rq, "__version__", "4.0.0")
    with pytest.raises(ValueError, match=r"rq 4.0.0 is installed, .* checked against rq 3.x only"):
        run_reward_worker(conn, ["math_boxed"], burst=True)
