"""`ExitConditions`: what a signal or the time limit makes `reason()` say, and when (the agreement is posted
before an iteration and read after it, so a signal that arrives during iteration N stops after N + 1)."""
import os
import signal

from megatron.training.exit_conditions import ExitConditions


def test_a_signal_before_the_post_is_read_after_that_iteration():
    exits = ExitConditions(True, None)
    try:
        exits.post()
        assert exits.reason() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # between iterations: recorded, the process lives on
        exits.post()
        assert exits.reason() == "received SIGUSR1 (--exit-signal-handler)"
    finally:
        exits.close()


def test_a_signal_during_an_iteration_stops_after_the_next_one():
    exits = ExitConditions(True, None)
    try:
        exits.post()
        os.kill(os.getpid(), signal.SIGTERM)  # while the iteration runs: the posted flags are already sent
        assert exits.reason() is None
        exits.post()
        assert exits.reason() == "received SIGTERM (--exit-signal-handler)"
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal changes nothing
        assert exits.reason() == "received SIGTERM (--exit-signal-handler)"
    finally:
        exits.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # close() restored the handlers


def test_time_limit_and_inactive_conditions():
    expired = ExitConditions(False, 1e-9, started=0.0)
    assert expired.reason() == "the run has lasted 1e-09 minutes (--exit-duration-in-mins)"
    assert expired.blocked_s >= 0.0
    idle = ExitConditions(False, None)
    idle.post()
    assert idle.reason() is None and idle._pending is None  # nothing posted when no condition is set
