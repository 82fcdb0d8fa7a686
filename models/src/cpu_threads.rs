//! The thread count of candle's CPU ops, settled once per process.

/// Sets `RAYON_NUM_THREADS` to the count candle picks (physical cores), unless it is set.
///
/// candle asks for its thread count on every CPU op, and without `RAYON_NUM_THREADS` it counts
/// physical cores by parsing `/proc/cpuinfo` (`num_cpus::get_physical`) each time: on a 2-core
/// VM that took 15% of Whisper one window at a time and 30% of one short text through BERT.
/// With the variable set, the count is an environment read. rayon's global pool (tern's own
/// kernels) takes the same count instead of the logical CPUs.
///
/// Call it first thing in `main`, before other threads start: it changes the environment.
pub fn settle_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let threads = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
}
