use crate::config::LogArgs;
use tracing_subscriber::EnvFilter;

/// Structured logs to stderr, as text or JSON lines.
pub fn init(args: &LogArgs) {
    let filter = EnvFilter::try_new(&args.log).unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal: log files and collectors get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if args.log_format == "json" {
        builder.json().flatten_event(true).with_current_span(false).init();
    } else {
        builder.init();
    }
}
