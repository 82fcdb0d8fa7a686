//! What the CLI prints: for people on a terminal, JSON for programs. Results go to stdout,
//! notes, progress and errors to stderr.

use serde_json::Value;
use std::io::{IsTerminal, Write};

pub struct Output {
    /// JSON on stdout: `--json`, or stdout is not a terminal.
    pub json: bool,
    /// stderr is a terminal: progress bars; else progress as plain lines.
    pub bars: bool,
}

impl Output {
    pub fn new(force_json: bool) -> Output {
        Output { json: force_json || !std::io::stdout().is_terminal(), bars: std::io::stderr().is_terminal() }
    }

    /// A result: one line of JSON, or pretty JSON for people.
    pub fn print(&self, value: &Value) {
        let text = if self.json { value.to_string() } else { serde_json::to_string_pretty(value).expect("JSON") };
        println!("{text}");
    }

    /// Text for people (a transcript, generated text); JSON mode prints `value` instead.
    pub fn text_or(&self, text: &str, value: &Value) {
        if self.json {
            self.print(value);
        } else {
            println!("{}", text.trim_end());
        }
    }

    /// Rows as an aligned table, or each row as a line of JSON.
    pub fn table(&self, rows: &[Value], columns: &[&str]) {
        if self.json {
            for row in rows {
                self.print(row);
            }
            return;
        }
        let cell = |row: &Value, c: &str| match &row[c] {
            Value::Null => "-".to_string(),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let widths: Vec<usize> =
            columns.iter().map(|c| rows.iter().map(|r| cell(r, c).chars().count()).max().unwrap_or(0).max(c.len())).collect();
        let mut stdout = std::io::stdout().lock();
        let line = |cells: Vec<String>| cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ");
        let _ = writeln!(stdout, "{}", line(columns.iter().map(|c| c.to_uppercase()).collect()).trim_end());
        for row in rows {
            let _ = writeln!(stdout, "{}", line(columns.iter().map(|c| cell(row, c)).collect()).trim_end());
        }
    }

    /// A note for people, on stderr.
    pub fn note(&self, message: &str) {
        eprintln!("{message}");
    }

    pub fn error(&self, e: &anyhow::Error) {
        eprintln!("error: {e:#}");
    }
}
