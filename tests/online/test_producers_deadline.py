"""A generation process that stays alive but answers nothing (here: stopped with SIGSTOP right after it was sent a
round) is ended after rollout_request_timeout_s and handled as a dead one: restarted, its rounds resent with their
seeds, and the run ends with the parameters of an uninterrupted one."""

from __future__ import annotations

import os
import signal

from test_producers_process import PROCESS, assert_same_parameters, same_threads
from test_producers_thread import grpo, losses

from posttrain.online.producers.process import ProcessRolloutProducer


class StopAfterSending:
    """Stops (SIGSTOP: alive, silent) the generation process right after it was sent request `request_id`."""

    def __init__(self, producer: ProcessRolloutProducer, request_id: int):
        self.producer, self.request_id, self.stopped = producer, request_id, False
        self.send = producer._send
        producer._send = self

    def __call__(self, request):
        self.send(request)
        if request.id == self.request_id and not self.stopped:
            os.kill(self.producer.process.pid, signal.SIGSTOP)
            self.stopped = True


def test_a_silent_generation_process_is_replaced_after_the_deadline(tmp_path, tiny_model_path, same_threads, caplog):
    common = dict(max_steps=4, async_generation_rounds=1, async_inflight_weight_updates=False, **PROCESS)
    plain = grpo(tiny_model_path, tmp_path / "plain", **common)
    plain.train()
    silent = grpo(tiny_model_path, tmp_path / "silent", rollout_request_timeout_s=5.0, **common)
    stopper = StopAfterSending(silent.rollout_producer, request_id=2)
    with caplog.at_level("WARNING", logger="posttrain"):
        silent.train()
    assert stopper.stopped
    assert "answered nothing for 5 s (rollout_request_timeout_s)" in caplog.text
    assert "exited (code -9); restarting it and resending" in caplog.text
    assert losses(silent) == losses(plain)
    assert_same_parameters(plain, silent)
