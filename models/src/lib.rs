pub mod audio;
pub mod whisper;
