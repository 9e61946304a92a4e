"""cotrain sandbox harness: runs inside the bubblewrap sandbox, never in the server.

The server hands it a JSON job on fd 3 and reads JSON event lines back on fd 4. The harness process
is a supervisor that never runs model-written code itself: code runs in a forked worker that has
neither fd 3 nor fd 4, so printing (or writing to any fd it holds) cannot forge the report, and the
supervisor marks itself non-dumpable so the worker cannot reach its descriptors through /proc.

Events are written as they happen, so if the supervisor itself is killed the server still has the
outcomes so far.

Modes:
  tests: parse `code` (syntax report), exec it once in a fresh namespace (setup), then run each
         test statement separately in that namespace with a per-test wall-clock limit: an alarm
         inside the worker first (as the original reward's; the namespace survives it), then, if
         the program ignores or swallows it, the supervisor kills the worker (which cannot block
         that) and a fresh worker re-runs the setup and continues. After `max_timeouts` timeouts
         testing stops.
         If the worker dies mid-test (os._exit, a signal), that test fails and testing stops.
  exec:  write `code` to main.py and run it as a child with the sandbox's stdin/stdout/stderr,
         then report its exit code or signal.
"""

import ast
import json
import os
import re
import resource
import select
import signal
import sys
import time

JOB_FD = 3
REPORT_FD = 4
MAX_MESSAGE_CHARS = 2000


def emit(event):
    data = (json.dumps(event) + "\n").encode()
    view = memoryview(data)
    while view:
        n = os.write(REPORT_FD, view)
        view = view[n:]


def read_fd(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def set_dumpable(flag):
    # Non-dumpable: /proc/<pid>/fd and ptrace of this process are closed to same-uid processes.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 1 if flag else 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except Exception:
        pass


def short(text):
    text = str(text)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def wait_status(pid):
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"exit_code": os.WEXITSTATUS(status)}


# ---------------------------------------------------------------- exec mode


def run_exec(job):
    with open("main.py", "w", encoding="utf-8") as f:
        f.write(job["code"])
    pid = os.fork()
    if pid == 0:
        try:
            os.close(REPORT_FD)
            set_dumpable(True)
            os.execv(sys.executable, [sys.executable, "-I", "main.py"])
        finally:
            os._exit(127)
    emit(dict(event="exit", **wait_status(pid)))


# ---------------------------------------------------------------- tests mode


class Worker:
    """A forked interpreter holding the program's namespace, driven over two pipes."""

    def __init__(self, code):
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(cmd_w)
            os.close(res_r)
            os.close(REPORT_FD)
            worker_main(code, cmd_r, res_w)  # never returns
        os.close(cmd_r)
        os.close(res_w)
        self.pid = pid
        self.cmd = cmd_w
        self.res = res_r
        self.buf = b""

    def send(self, index):
        try:
            os.write(self.cmd, b"%d\n" % index)
            return True
        except OSError:
            return False

    def receive(self, timeout_secs):
        """The next message, "timeout", or "eof" (the worker died)."""
        deadline = time.monotonic() + timeout_secs
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([self.res], [], [], left)
            if not ready:
                return "timeout"
            chunk = os.read(self.res, 1 << 16)
            if not chunk:
                return "eof"
            self.buf += chunk
            if len(self.buf) > (1 << 20):
                return "eof"
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            return "eof"
        return msg if isinstance(msg, dict) else "eof"

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        return self.reap()

    def reap(self):
        for fd in (self.cmd, self.res):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            return wait_status(self.pid)
        except ChildProcessError:
            return {}


def worker_main(code, cmd_r, res_w):
    set_dumpable(True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)

    def reply(msg):
        os.write(res_w, (json.dumps(msg) + "\n").encode())

    def describe(exc):
        return {"error_type": type(exc).__name__, "message": short(exc)}

    namespace = {}
    double_call = WORKER_OPTIONS.get("double_call")
    signal.signal(signal.SIGALRM, raise_test_timeout)
    try:
        exec(compile(code, "<solution>", "exec"), namespace)
        reply({"kind": "setup", "status": "ok"})
    except BaseException as exc:  # noqa: BLE001 - the program may raise anything, SystemExit included
        reply(dict(kind="setup", status="error", **describe(exc)))
        os._exit(0)
    commands = os.fdopen(cmd_r, "rb", buffering=0)
    tests = WORKER_TESTS
    while True:
        line = commands.readline()
        if not line:
            os._exit(0)
        index = int(line)
        try:
            # The test's own time limit, raised inside the program as the original reward did
            # (SIGALRM): the namespace survives a timeout, so a function that is slow only on its
            # first call passes later tests. The supervisor's kill is the backstop.
            signal.setitimer(signal.ITIMER_REAL, WORKER_OPTIONS["per_test"])
            call = DOUBLE_CALL.search(tests[index]) if double_call else None
            if call:
                # The original reward's way: evaluate the call, then the expected value, then run
                # the whole assert (the call's function runs twice).
                eval(call.group(1) + "(" + call.group(2) + ")", namespace)
                eval(call.group(3), namespace)
            exec(compile(tests[index], "<test>", "exec"), namespace)
            signal.setitimer(signal.ITIMER_REAL, 0)
            reply({"kind": "test", "index": index, "passed": True})
        except TestTimeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
            reply({"kind": "test", "index": index, "passed": False, "timed_out": True})
        except BaseException as exc:  # noqa: BLE001
            signal.setitimer(signal.ITIMER_REAL, 0)
            reply(dict(kind="test", index=index, passed=False, **describe(exc)))


class TestTimeout(Exception):
    """A test ran past its limit (an Exception, as the original's, so code may catch it)."""


def raise_test_timeout(signum, frame):
    raise TestTimeout("test exceeded its time limit")


WORKER_TESTS = []
WORKER_OPTIONS = {}
DOUBLE_CALL = re.compile(r"assert\s+(\w+)\(([^)]*)\)\s*==\s*(.+)")


def run_tests(job):
    code = job["code"]
    tests = job["tests"]
    per_test = float(job["per_test_timeout_secs"])
    setup_timeout = float(job.get("setup_timeout_secs") or per_test)
    max_timeouts = int(job["max_timeouts"])
    WORKER_TESTS.extend(tests)
    WORKER_OPTIONS["double_call"] = bool(job.get("double_call"))
    WORKER_OPTIONS["per_test"] = per_test
    # The supervisor waits a little longer than the in-program alarm before it kills the worker.
    backstop = per_test * 1.5 + 1.0

    # The syntax check is Python's parser (`ast.parse`, as the original reward uses); errors that
    # only the compiler finds (`return` outside a function, ...) surface when the program is set up.
    try:
        ast.parse(code)
        emit({"event": "syntax", "status": "ok"})
    except (SyntaxError, ValueError) as exc:
        emit(
            {
                "event": "syntax",
                "status": "error",
                "error_type": type(exc).__name__,
                "message": short(getattr(exc, "msg", None) or exc),
                "line": getattr(exc, "lineno", None),
                "column": getattr(exc, "offset", None),
            }
        )
        emit({"event": "setup", "status": "skipped"})
        emit({"event": "done", "timeouts": 0, "stopped_after_timeouts": False})
        return

    timeouts = 0
    worker = None
    setup_reported = False
    aborted = None
    index = 0
    while index < len(tests):
        if worker is None:
            worker = Worker(code)
            msg = worker.receive(setup_timeout)
            if not isinstance(msg, dict) or msg.get("status") != "ok":
                if msg == "timeout":
                    status = worker.kill()
                    outcome = {"status": "timed_out"}
                elif msg == "eof":
                    status = worker.reap()
                    outcome = {"status": "error", "error_type": "ProcessExited",
                               "message": exit_description(status)}
                elif msg.get("kind") != "setup":
                    # The program wrote on the worker's result pipe itself.
                    worker.kill()
                    outcome = {"status": "error", "error_type": "ProtocolError",
                               "message": "unexpected output on the harness's result channel"}
                else:
                    worker.reap()
                    outcome = {"status": "error", "error_type": str(msg.get("error_type")),
                               "message": str(msg.get("message", ""))}
                if not setup_reported:
                    emit(dict(event="setup", **outcome))
                    emit({"event": "done", "timeouts": 0, "stopped_after_timeouts": False})
                    return
                aborted = "setup failed when re-run after a timeout: " + outcome.get("message", outcome["status"])
                break
            if not setup_reported:
                emit({"event": "setup", "status": "ok"})
                setup_reported = True

        if not worker.send(index):
            msg = "eof"
        else:
            msg = worker.receive(backstop)
        if isinstance(msg, dict) and msg.get("kind") == "test" and msg.get("index") == index and msg.get("timed_out"):
            timeouts += 1
            emit({"event": "test", "index": index, "passed": False, "timed_out": True,
                  "error_type": "TimeoutError", "message": "test exceeded %gs" % per_test})
            index += 1
            if timeouts >= max_timeouts:
                break
            continue
        if msg == "timeout":
            worker.kill()
            worker = None
            timeouts += 1
            emit({"event": "test", "index": index, "passed": False, "timed_out": True,
                  "error_type": "TimeoutError", "message": "test exceeded %gs" % per_test})
            index += 1
            if timeouts >= max_timeouts:
                break
            continue
        if msg == "eof" or msg.get("kind") != "test" or msg.get("index") != index:
            status = worker.kill()
            worker = None
            cpu_exhausted = status.get("signal") in (signal.SIGXCPU,)
            if cpu_exhausted:
                timeouts += 1
            emit({"event": "test", "index": index, "passed": False, "timed_out": cpu_exhausted,
                  "error_type": "CpuTimeExceeded" if cpu_exhausted else "ProcessExited",
                  "message": exit_description(status)})
            aborted = "the program's process ended during test %d (%s)" % (index, exit_description(status))
            break
        emit({"event": "test", "index": index, "passed": bool(msg.get("passed")), "timed_out": False,
              "error_type": None if msg.get("passed") else str(msg.get("error_type")),
              "message": None if msg.get("passed") else short(msg.get("message", ""))})
        index += 1

    if worker is not None:
        worker.kill()
    if not setup_reported:
        emit({"event": "setup", "status": "ok"})
    emit({"event": "done", "timeouts": timeouts,
          "stopped_after_timeouts": timeouts >= max_timeouts and index < len(tests) and aborted is None,
          "aborted": aborted})


def exit_description(status):
    if "signal" in status:
        try:
            name = signal.Signals(status["signal"]).name
        except ValueError:
            name = str(status["signal"])
        return "killed by " + name
    if "exit_code" in status:
        return "exited with code %d" % status["exit_code"]
    return "ended"


def main():
    job = json.loads(read_fd(JOB_FD))
    os.close(JOB_FD)
    max_processes = job.get("max_processes")
    if max_processes:
        # Set here rather than before bwrap: inside the new user namespace the count covers only
        # this sandbox's processes (see sandbox/rlimits.rs).
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
    set_dumpable(False)
    if job["mode"] == "exec":
        run_exec(job)
    else:
        run_tests(job)


if __name__ == "__main__":
    main()
