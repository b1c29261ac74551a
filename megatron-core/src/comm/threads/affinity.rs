//! Pinning rank threads to cores, so that ranks spread evenly over the machine and collectives
//! can wake helpers that run on different cores.

/// The CPUs this process may run on, in ascending order (empty where unknown).
pub(crate) fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `set` is a plain bitmask that sched_getaffinity fills; CPU_ISSET reads it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Vec::new();
            }
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
                .collect()
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        Vec::new()
    }
}

/// Lets the calling thread run on every CPU the process may use (the main thread's set): a
/// thread started by a pinned rank thread inherits its one CPU, which a pool of workers meant
/// to spread over the cores must not keep. Returns whether it worked.
pub(crate) fn unpin_current_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: as above; the process's id names its main thread, which launch never pins.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(libc::getpid(), size_of::<libc::cpu_set_t>(), &mut set) != 0
            {
                return false;
            }
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// Pins the calling thread to `cpu`; returns whether it worked.
pub(crate) fn pin_current_thread(cpu: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: as above; 0 names the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_ZERO(&mut set);
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpu;
        false
    }
}
