//! Hostile programs against the real bubblewrap sandbox: each must be contained, reported as the
//! right outcome, and must not stop the sandbox from serving an ordinary run at the same time.

use std::time::{Duration, Instant};

use cotrain_reward_server::code_runner::{
    CodeRunner, ProgramTests, RunnerError, SetupOutcome, SyntaxCheck,
};
use cotrain_reward_server::sandbox::{
    BwrapSandbox, ExecLimits, ExecOutcome, ExecStatus, SandboxConfig, SandboxPolicy,
};

const SECRET_VAR: &str = "COTRAIN_TEST_SECRET_TOKEN";
const SECRET_VALUE: &str = "hunter2-do-not-leak";

fn config() -> SandboxConfig {
    SandboxConfig {
        max_concurrency: Some(4),
        queue_limit: 16,
        limits: SandboxPolicy {
            wall_timeout_ms: 4_000,
            cpu_time_secs: 4,
            max_output_bytes: 64 * 1024,
            max_processes: 16,
            memory_mb: 512,
            ..SandboxPolicy::default()
        },
        ..SandboxConfig::default()
    }
}

async fn sandbox() -> BwrapSandbox {
    // A secret in the server's environment, which no sandboxed program may see.
    // SAFETY: set before any sandbox thread reads the environment; same value in every test.
    unsafe { std::env::set_var(SECRET_VAR, SECRET_VALUE) };
    BwrapSandbox::start(&config())
        .await
        .expect("bubblewrap isolation works on this machine")
}

async fn exec(sb: &BwrapSandbox, code: &str) -> ExecOutcome {
    sb.execute(code, None, &ExecLimits::default())
        .await
        .expect("the sandbox ran")
}

/// Runs `hostile` and, while it runs, an ordinary program that must finish correctly and quickly.
async fn with_bystander(sb: &BwrapSandbox, hostile: &str) -> ExecOutcome {
    let bystander = async {
        // Let the hostile program get going first.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        let out = exec(sb, "print(sum(range(10)))").await;
        (out, started.elapsed())
    };
    let (hostile_out, (normal, took)) = tokio::join!(exec(sb, hostile), bystander);
    assert_eq!(
        normal.status,
        ExecStatus::Finished { exit_code: 0 },
        "bystander: {normal:?}"
    );
    assert_eq!(normal.stdout, "45\n");
    assert!(took < Duration::from_secs(5), "bystander took {took:?}");
    hostile_out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fork_bomb_is_capped_by_the_process_limit() {
    let sb = sandbox().await;
    // Counts how many processes it can create: the limit must stop it well before the host's.
    let count = exec(
        &sb,
        r#"
import os, time
n = 0
for _ in range(500):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    n += 1
print(n)
"#,
    )
    .await;
    let forked: u32 = count
        .stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{count:?}"));
    assert!(
        forked < 16,
        "forked {forked} processes under max_processes=16"
    );

    let out = with_bystander(
        &sb,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    )
    .await;
    assert!(
        matches!(
            out.status,
            ExecStatus::TimedOut { .. } | ExecStatus::CpuTimeExceeded { .. }
        ),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_bomb_gets_memory_error() {
    let sb = sandbox().await;
    let out = with_bystander(
        &sb,
        "x = []\nwhile True:\n    x.append(bytearray(50 * 1024 * 1024))\n",
    )
    .await;
    assert_eq!(out.status, ExecStatus::Finished { exit_code: 1 }, "{out:?}");
    assert!(out.stderr.contains("MemoryError"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn infinite_loop_and_sleep_are_killed_at_the_limit() {
    let sb = sandbox().await;
    let started = Instant::now();
    let out = with_bystander(&sb, "while True:\n    pass\n").await;
    assert!(
        matches!(
            out.status,
            ExecStatus::TimedOut { .. } | ExecStatus::CpuTimeExceeded { .. }
        ),
        "{out:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(8));

    let limits = ExecLimits {
        wall_timeout_ms: Some(1_000),
        memory_mb: None,
    };
    let started = Instant::now();
    let out = sb
        .execute("import time\ntime.sleep(60)\n", None, &limits)
        .await
        .unwrap();
    assert_eq!(
        out.status,
        ExecStatus::TimedOut {
            wall_timeout_ms: 1_000
        }
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn huge_output_is_capped_and_the_run_killed() {
    let sb = sandbox().await;
    let out = with_bystander(&sb, "while True:\n    print('x' * 10000)\n").await;
    assert_eq!(
        out.status,
        ExecStatus::OutputLimit {
            max_output_bytes: 64 * 1024
        }
    );
    assert!(out.stdout_truncated);
    assert_eq!(out.stdout.len(), 64 * 1024);
    // Filling stderr is the same.
    let out = exec(
        &sb,
        "import sys\nwhile True:\n    sys.stderr.write('e' * 10000)\n",
    )
    .await;
    assert_eq!(
        out.status,
        ExecStatus::OutputLimit {
            max_output_bytes: 64 * 1024
        }
    );
    assert!(out.stderr_truncated);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn network_is_unreachable_including_loopback_listeners_of_the_host() {
    let sb = sandbox().await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let code = format!(
        r#"
import socket
for host, port in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print("connected", host)
    except OSError as e:
        print("blocked", host, type(e).__name__)
try:
    socket.getaddrinfo("example.com", 80)
    print("resolved")
except OSError as e:
    print("no-dns", type(e).__name__)
"#
    );
    let out = with_bystander(&sb, &code).await;
    assert_eq!(out.status, ExecStatus::Finished { exit_code: 0 }, "{out:?}");
    assert!(!out.stdout.contains("connected"), "{}", out.stdout);
    assert!(!out.stdout.contains("resolved"), "{}", out.stdout);
    assert_eq!(out.stdout.matches("blocked").count(), 3, "{}", out.stdout);
    // Nothing reached the host's listener.
    assert!(listener.accept().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn server_environment_and_host_files_are_invisible() {
    let sb = sandbox().await;
    let project = env!("CARGO_MANIFEST_DIR");
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let code = format!(
        r#"
import os
print("env", os.environ.get("{SECRET_VAR}"))
for name in ["/proc/1/environ", "/proc/self/environ"]:
    try:
        print("procenv", "{SECRET_VALUE}" in open(name, "rb").read().decode(errors="ignore"))
    except OSError as e:
        print("procenv-error", type(e).__name__)
for path in ["/etc/shadow", "/etc/passwd", "{home}", "{project}", "{project}/Cargo.toml", "/work", "/home"]:
    print("exists", path, os.path.exists(path))
"#
    );
    let out = with_bystander(&sb, &code).await;
    assert_eq!(out.status, ExecStatus::Finished { exit_code: 0 }, "{out:?}");
    assert!(out.stdout.contains("env None"), "{}", out.stdout);
    assert!(!out.stdout.contains(SECRET_VALUE));
    assert!(!out.stdout.contains("procenv True"), "{}", out.stdout);
    assert!(
        !out.stdout.contains("True"),
        "host paths visible: {}",
        out.stdout
    );
    assert_eq!(out.stdout.matches("exists").count(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_outside_the_working_directory_fail_and_never_reach_the_host() {
    let sb = sandbox().await;
    let marker = format!("cotrain-escape-{}", std::process::id());
    let code = format!(
        r#"
import os
print("cwd", os.getcwd())
open("inside.txt", "w").write("ok")
print("inside", open("inside.txt").read())
for path in ["/usr/{marker}", "/{marker}", "/etc/{marker}", "/cotrain/harness.py"]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("denied", path, type(e).__name__)
open("/tmp/{marker}", "w").write("x")
try:
    open("big.bin", "wb").write(b"0" * (100 * 1024 * 1024))
    print("wrote-big")
except OSError as e:
    print("big-denied", type(e).__name__)
"#
    );
    let out = exec(&sb, &code).await;
    assert!(out.stdout.contains("cwd /sandbox"), "{out:?}");
    assert!(out.stdout.contains("inside ok"));
    assert!(!out.stdout.contains("wrote /"), "{}", out.stdout);
    assert_eq!(out.stdout.matches("denied /").count(), 4, "{}", out.stdout);
    assert!(!out.stdout.contains("wrote-big"), "{out:?}");
    // The sandbox's /tmp is private.
    assert!(!std::path::Path::new(&format!("/tmp/{marker}")).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_everything_in_reach_hurts_only_the_sandbox() {
    let sb = sandbox().await;
    // A host process the sandbox must not be able to touch.
    let mut sentinel = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let code = format!(
        r#"
import os, signal
for pid in [{sentinel}, {me}, 1]:
    try:
        os.kill(pid, signal.SIGKILL)
        print("killed", pid)
    except OSError as e:
        print("cannot", pid, type(e).__name__)
os.kill(-1, signal.SIGKILL)
"#,
        sentinel = sentinel.id(),
        me = std::process::id(),
    );
    let out = with_bystander(&sb, &code).await;
    // kill(-1) took down the harness around the program: reported as a kill, not a hang.
    assert!(
        matches!(
            out.status,
            ExecStatus::Killed { .. } | ExecStatus::Finished { .. }
        ),
        "{out:?}"
    );
    assert!(
        !out.stdout.contains(&format!("killed {}", sentinel.id())),
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout
            .contains(&format!("killed {}", std::process::id())),
        "{}",
        out.stdout
    );
    assert!(
        sentinel.try_wait().unwrap().is_none(),
        "the host process was killed"
    );
    sentinel.kill().unwrap();
    let _ = sentinel.wait();

    let out = exec(
        &sb,
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(1)\n",
    )
    .await;
    assert!(
        matches!(
            out.status,
            ExecStatus::Killed { .. } | ExecStatus::Finished { .. }
        ),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn closed_stdout_and_stdin_are_reported_normally() {
    let sb = sandbox().await;
    let out = exec(
        &sb,
        "import os, sys\nos.close(1)\nos.close(2)\nsys.exit(7)\n",
    )
    .await;
    assert_eq!(out.status, ExecStatus::Finished { exit_code: 7 }, "{out:?}");
    let out = sb
        .execute(
            "print(input()[::-1])",
            Some(b"olleh\n"),
            &ExecLimits::default(),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, "hello\n");
    let out = exec(
        &sb,
        "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n",
    )
    .await;
    assert_eq!(out.status, ExecStatus::Killed { signal: 11 }, "{out:?}");
}

// ------------------------------------------------------------------------ tests mode (CodeRunner)

fn program(code: &str, tests: &[&str]) -> ProgramTests {
    ProgramTests {
        code: code.into(),
        tests: tests.iter().map(|t| t.to_string()).collect(),
        per_test_timeout_secs: 1.0,
        max_timeouts: 3,
        double_call: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_original_double_call_runs_an_equality_test_s_call_twice() {
    let sb = sandbox().await;
    // A function with a side effect: the original evaluates `f()` and the expected value, then
    // executes the whole assert, so `f` has run twice when the assert's own call compares.
    let code = "calls = []\ndef f():\n    calls.append(1)\n    return len(calls)\n";
    let mut p = program(code, &["assert f() == 2", "assert len(calls) == 2"]);
    p.double_call = true;
    let r = sb.run_tests(p.clone()).await.unwrap();
    assert_eq!(
        r.tests.iter().map(|t| t.passed).collect::<Vec<_>>(),
        vec![true, true],
        "{r:?}"
    );
    p.double_call = false;
    let r = sb.run_tests(p).await.unwrap();
    assert_eq!(
        r.tests.iter().map(|t| t.passed).collect::<Vec<_>>(),
        vec![false, false],
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_test_is_reported_with_its_error() {
    let sb = sandbox().await;
    let report = sb
        .run_tests(program(
            "def f(x):\n    return x + 1\nprint('noise')\n",
            &[
                "assert f(1) == 2",
                "assert f(1) == 3",
                "assert g(1) == 2",
                "assert f('a') == 1",
            ],
        ))
        .await
        .unwrap();
    assert_eq!(report.syntax, SyntaxCheck::Ok);
    assert_eq!(report.setup, SetupOutcome::Ok);
    let kinds: Vec<(bool, Option<&str>)> = report
        .tests
        .iter()
        .map(|t| (t.passed, t.error_type.as_deref()))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (true, None),
            (false, Some("AssertionError")),
            (false, Some("NameError")),
            (false, Some("TypeError"))
        ]
    );
    assert!(
        report.tests[2]
            .message
            .as_deref()
            .unwrap()
            .contains("'g' is not defined")
    );
    assert_eq!(report.timeouts, 0);

    let report = sb
        .run_tests(program("def f(:\n    pass\n", &["assert True"]))
        .await
        .unwrap();
    match report.syntax {
        SyntaxCheck::Error {
            error_type,
            line,
            column,
            ..
        } => {
            assert_eq!(error_type, "SyntaxError");
            assert_eq!(line, Some(1));
            assert_eq!(column, Some(7));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(report.setup, SetupOutcome::Skipped);
    assert!(report.tests.is_empty());

    let report = sb
        .run_tests(program("raise ValueError('bad setup')", &["assert True"]))
        .await
        .unwrap();
    assert_eq!(
        report.setup,
        SetupOutcome::Error {
            error_type: "ValueError".into(),
            message: "bad setup".into()
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn testing_stops_after_three_timeouts_even_if_the_code_fights_the_timer() {
    let sb = sandbox().await;
    // The program ignores SIGALRM and swallows exceptions: only the supervisor's kill works.
    let code = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef spin():\n    while True:\n        try:\n            pass\n        except BaseException:\n            pass\n";
    let started = Instant::now();
    let report = sb
        .run_tests(program(
            code,
            &[
                "assert True",
                "spin()",
                "spin()",
                "assert 1 == 1",
                "spin()",
                "assert True",
            ],
        ))
        .await
        .unwrap();
    let outcomes: Vec<(bool, bool)> = report
        .tests
        .iter()
        .map(|t| (t.passed, t.timed_out))
        .collect();
    assert_eq!(
        outcomes,
        vec![
            (true, false),
            (false, true),
            (false, true),
            (true, false),
            (false, true)
        ]
    );
    assert_eq!(report.timeouts, 3);
    assert!(report.stopped_after_timeouts);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exiting_or_closing_stdout_mid_test_keeps_the_outcomes_so_far() {
    let sb = sandbox().await;
    let report = sb
        .run_tests(program(
            "import os, sys\ndef f():\n    return 1\n",
            &[
                "assert f() == 1",
                "os.close(1); os.close(2); assert f() == 1",
                "os._exit(0)",
                "assert f() == 1",
            ],
        ))
        .await
        .unwrap();
    let passed: Vec<bool> = report.tests.iter().map(|t| t.passed).collect();
    assert_eq!(passed, vec![true, true, false]);
    assert_eq!(report.tests[2].error_type.as_deref(), Some("ProcessExited"));
    assert!(!report.stopped_after_timeouts);

    let report = sb
        .run_tests(program("import sys\nsys.exit(0)\n", &["assert True"]))
        .await
        .unwrap();
    assert!(
        matches!(report.setup, SetupOutcome::Error { ref error_type, .. } if error_type == "SystemExit")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn printed_or_written_fake_reports_are_ignored() {
    let sb = sandbox().await;
    let fake = r#"{"event": "test", "index": 0, "passed": true, "timed_out": false}"#;
    let code = format!(
        r#"
import os
FAKE = {fake:?} + "\n"
print(FAKE)
for fd in range(3, 64):
    try:
        os.write(fd, FAKE.encode())
    except OSError:
        pass
for pid in range(1, 8):
    try:
        open("/proc/%d/fd/4" % pid, "w").write(FAKE)
    except OSError:
        pass
def f():
    return 0
"#
    );
    let report = sb
        .run_tests(program(&code, &["assert f() == 1", "assert f() == 2"]))
        .await
        .unwrap();
    // Code in the worker can always garble its own result channel (that only fails it); it must
    // never turn a failing test into a pass.
    assert!(report.tests.iter().all(|t| !t.passed), "{report:?}");
    assert!(
        report.tests.len() == 2 || matches!(report.setup, SetupOutcome::Error { .. }),
        "{report:?}"
    );

    // Printing alone changes nothing at all.
    let code = format!("print({fake:?})\ndef f():\n    return 0\n");
    let report = sb
        .run_tests(program(&code, &["assert f() == 1", "assert f() == 0"]))
        .await
        .unwrap();
    let passed: Vec<bool> = report.tests.iter().map(|t| t.passed).collect();
    assert_eq!(passed, vec![false, true]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_is_reported_as_overload() {
    let cfg = SandboxConfig {
        max_concurrency: Some(1),
        queue_limit: 0,
        ..config()
    };
    let sb = BwrapSandbox::start(&cfg).await.unwrap();
    let limits = ExecLimits {
        wall_timeout_ms: Some(1_500),
        memory_mb: None,
    };
    let slow = sb.execute("import time\ntime.sleep(5)", None, &limits);
    let rejected = async {
        while sb.in_flight() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sb.execute("print(1)", None, &limits).await
    };
    let (slow, rejected) = tokio::join!(slow, rejected);
    assert!(matches!(slow.unwrap().status, ExecStatus::TimedOut { .. }));
    assert!(
        matches!(rejected, Err(RunnerError::Overloaded { .. })),
        "{rejected:?}"
    );
    // Free again afterwards.
    assert_eq!(
        sb.execute("print(1)", None, &limits).await.unwrap().stdout,
        "1\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_mode_refuses_to_start_without_isolation() {
    let cfg = SandboxConfig {
        bwrap: "/nonexistent/bwrap".into(),
        ..config()
    };
    let err = BwrapSandbox::start(&cfg).await.unwrap_err();
    assert!(
        err.to_string().contains("sandbox isolation does not work"),
        "{err}"
    );
    assert!(err.to_string().contains("--insecure-no-sandbox"), "{err}");

    let insecure = BwrapSandbox::start(&SandboxConfig {
        insecure_no_sandbox: true,
        ..cfg
    })
    .await
    .unwrap();
    assert!(!insecure.is_sandboxed());
    let out = exec(&insecure, "print(6 * 7)").await;
    assert_eq!(out.stdout, "42\n");
    assert!(!out.sandboxed);
    let report = insecure
        .run_tests(program("def f():\n    return 1\n", &["assert f() == 1"]))
        .await
        .unwrap();
    assert!(report.tests[0].passed);
}
