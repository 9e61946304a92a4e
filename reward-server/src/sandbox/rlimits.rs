//! Resource limits and the privilege drop, applied in the forked child just before it execs
//! bubblewrap (or, insecurely, python itself).
//!
//! Why RLIMIT_NPROC is not set here: the kernel counts processes per user, and a limit set before
//! bwrap creates its user namespace is checked against every process of that uid on the machine.
//! Set inside the sandbox (by the harness, after the namespace exists) it counts only that
//! sandbox's processes. It is also never enforced for real root, whatever the namespace, so a
//! server running as root starts bwrap as an unprivileged uid (`sandbox_uid`, default `nobody`).
//! Measured on this machine: as root a fork loop under RLIMIT_NPROC=8 made 50 processes; as uid
//! 65534 it stopped at 6.

use std::io;

/// Limits applied with setrlimit in the child; all values in the kernel's units.
#[derive(Debug, Clone, Copy)]
pub struct Rlimits {
    pub cpu_secs: u64,
    pub address_space_bytes: u64,
    pub file_size_bytes: u64,
    pub open_files: u64,
}

/// Everything the child does between fork and exec. Only async-signal-safe calls (raw syscalls).
#[derive(Debug, Clone, Copy)]
pub struct ChildSetup {
    pub limits: Rlimits,
    /// Drop to this uid/gid (and no supplementary groups) before exec.
    pub drop_to_uid: Option<u32>,
    /// (source, target) pairs to dup2 before exec: the job and report pipes to fds 3 and 4.
    pub fd_moves: [(i32, i32); 2],
}

fn check(ret: libc::c_long) -> io::Result<()> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn set(resource: libc::__rlimit_resource_t, value: u64) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: value as libc::rlim_t,
        rlim_max: value as libc::rlim_t,
    };
    // SAFETY: setrlimit reads a valid, initialised struct.
    check(unsafe { libc::setrlimit(resource, &lim) } as libc::c_long)
}

impl ChildSetup {
    /// Runs in the forked child.
    ///
    /// # Safety
    /// Must only be called between fork and exec (it changes the calling process's identity).
    pub unsafe fn apply(&self) -> io::Result<()> {
        // Own process group, so a timeout can kill everything the child started (insecure mode;
        // bwrap's PID namespace covers that in the sandbox).
        // SAFETY: plain syscalls on the current process.
        check(unsafe { libc::setpgid(0, 0) } as libc::c_long)?;
        // Move the pipe ends to their fixed numbers. Go through high descriptors first so that a
        // source that happens to be 3 or 4 is not clobbered.
        let mut high = [0i32; 2];
        for (i, (src, _)) in self.fd_moves.iter().enumerate() {
            // SAFETY: duplicating a descriptor we own.
            let fd = unsafe { libc::fcntl(*src, libc::F_DUPFD_CLOEXEC, 100) };
            check(fd as libc::c_long)?;
            high[i] = fd;
        }
        for (i, (_, dst)) in self.fd_moves.iter().enumerate() {
            // SAFETY: dup2 onto a fixed number; dup2 clears FD_CLOEXEC on the target.
            check(unsafe { libc::dup2(high[i], *dst) } as libc::c_long)?;
        }
        set(libc::RLIMIT_CPU, self.limits.cpu_secs)?;
        set(libc::RLIMIT_AS, self.limits.address_space_bytes)?;
        set(libc::RLIMIT_FSIZE, self.limits.file_size_bytes)?;
        set(libc::RLIMIT_NOFILE, self.limits.open_files)?;
        set(libc::RLIMIT_CORE, 0)?;
        if let Some(uid) = self.drop_to_uid {
            // Raw syscalls: glibc's wrappers would try to synchronise threads that do not exist
            // in the forked child.
            // SAFETY: identity-changing syscalls with plain integer arguments.
            unsafe {
                check(libc::syscall(
                    libc::SYS_setgroups,
                    0,
                    std::ptr::null::<libc::gid_t>(),
                ))?;
                check(libc::syscall(libc::SYS_setresgid, uid, uid, uid))?;
                check(libc::syscall(libc::SYS_setresuid, uid, uid, uid))?;
            }
        }
        // After the uid change, which would clear it: if the server dies, so does the sandbox.
        // SAFETY: prctl with integer arguments.
        check(
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) } as libc::c_long,
        )?;
        Ok(())
    }
}

/// The effective uid of the server.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}
