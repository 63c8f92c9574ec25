def wait_child(pid: int, timeout_s: float) -> int:
    """Wait (polling, bounded by ``timeout_s`` seconds) for a forked child; its exit code."""
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        assert time.monotonic() < deadline, "fork child did not finish"
        time.sleep(0.01)
