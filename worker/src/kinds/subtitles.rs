//! SRT and WebVTT renderings of transcript segments.

use tern_models::whisper::Segment;

/// `HH:MM:SS{sep}mmm`, as SRT (`,`) and VTT (`.`) write times.
fn timestamp(seconds: f64, sep: char) -> String {
    let ms = (seconds.max(0.0) * 1000.0).round() as u64;
    format!("{:02}:{:02}:{:02}{sep}{:03}", ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000)
}

pub fn srt(segments: &[Segment]) -> String {
    let mut out = String::new();
    for (i, s) in segments.iter().enumerate() {
        out.push_str(&format!(
            "{}\n{} --> {}\n{}\n\n",
            i + 1,
            timestamp(s.start, ','),
            timestamp(s.end, ','),
            s.text.trim()
        ));
    }
    out
}

pub fn vtt(segments: &[Segment]) -> String {
    let mut out = String::from("WEBVTT\n\n");
    for s in segments {
        out.push_str(&format!("{} --> {}\n{}\n\n", timestamp(s.start, '.'), timestamp(s.end, '.'), s.text.trim()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segments() -> Vec<Segment> {
        vec![
            Segment { start: 0.0, end: 2.5, text: " Hello there.".into(), words: None },
            Segment { start: 3661.25, end: 3662.0, text: "An hour later.".into(), words: None },
        ]
    }

    #[test]
    fn srt_numbers_cues_and_uses_commas() {
        assert_eq!(
            srt(&segments()),
            "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n2\n01:01:01,250 --> 01:01:02,000\nAn hour later.\n\n"
        );
    }

    #[test]
    fn vtt_has_its_header_and_uses_dots() {
        assert_eq!(
            vtt(&segments()),
            "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n01:01:01.250 --> 01:01:02.000\nAn hour later.\n\n"
        );
    }
}
