"""The background artifact queue of the flows: order, context, failures, close."""

import contextvars
import logging
import threading

from flows.artifacts import BackgroundArtifacts, artifact_key

RUN = contextvars.ContextVar("run", default=None)


def test_artifact_key_is_what_prefect_accepts():
    assert artifact_key("RL_tiny.v2", "rl-step") == "rl-tiny-v2-rl-step"


def test_calls_run_in_order_off_the_caller_thread_with_its_context():
    seen = []
    RUN.set("flow-run-7")
    with BackgroundArtifacts() as bg:
        for i in range(5):
            bg.submit(lambda i=i: seen.append((i, RUN.get(), threading.current_thread().name)))
    assert [s[0] for s in seen] == list(range(5))
    assert all(run == "flow-run-7" and name.startswith("artifacts") for _, run, name in seen)


def test_a_failing_call_is_logged_and_the_rest_still_run(caplog):
    seen = []

    def boom():
        raise RuntimeError("server said 500")

    with caplog.at_level(logging.WARNING):
        bg = BackgroundArtifacts()
        bg.submit(boom)
        bg.submit(seen.append, 1)
        bg.close()
    assert seen == [1]
    assert "server said 500" in caplog.text


def test_close_gives_up_on_a_call_that_hangs(caplog):
    release = threading.Event()
    bg = BackgroundArtifacts()
    bg.submit(release.wait, 30)
    with caplog.at_level(logging.WARNING):
        bg.close(timeout=0.2)
    release.set()
    assert "publishing an artifact failed" in caplog.text
