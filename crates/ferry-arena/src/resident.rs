//! This process's resident memory, for the tests and benchmarks that show a release really
//! returns memory to the OS (the KV arena, sleep levels 1 and 2).
//!
//! Linux only (`/proc/self/status`); elsewhere it is `None`. Read by hand: it is one line of
//! one file, and the crates that read process statistics pull in far more than that.

/// `VmRSS` in bytes, or `None` where the kernel does not report it.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_rss(&status)
}

/// The `VmRSS:` line of a `/proc/<pid>/status` text, in bytes.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_the_vm_rss_line() {
        let status = "Name:\tx\nVmPeak:\t  999 kB\nVmRSS:\t  1234 kB\nThreads:\t1\n";
        assert_eq!(super::parse_vm_rss(status), Some(1234 * 1024));
        assert_eq!(super::parse_vm_rss("Name:\tx\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process() {
        assert!(super::resident_bytes().is_some_and(|b| b > 0));
    }
}
