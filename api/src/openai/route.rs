//! The OpenAI routes a request can be sent to as JSON, for the Batch API: each line of a batch
//! names one and carries its body.

use super::audio::Transcription;
use super::chat::{Completion, Flavour};
use super::embeddings::Embeddings;
use super::images::ImageGeneration;
use super::OpenAiError;
use serde_json::Value;
use tern_jobs::Job;

/// A route a batch line may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Transcriptions,
    Translations,
    Embeddings,
    ChatCompletions,
    Completions,
    ImageGenerations,
}

impl Route {
    pub const ALL: [Route; 6] =
        [Route::Transcriptions, Route::Translations, Route::Embeddings, Route::ChatCompletions, Route::Completions, Route::ImageGenerations];

    pub fn path(self) -> &'static str {
        match self {
            Route::Transcriptions => "/v1/audio/transcriptions",
            Route::Translations => "/v1/audio/translations",
            Route::Embeddings => "/v1/embeddings",
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::ImageGenerations => "/v1/images/generations",
        }
    }

    pub fn parse(path: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.path() == path)
    }

    /// The paths, for messages.
    pub fn listed() -> String {
        Route::ALL.map(Route::path).join(", ")
    }

    /// Whether this route's answers name images, whose URLs are presigned into the job's
    /// output before [`Request::response`] reads it.
    pub fn names_images(self) -> bool {
        self == Route::ImageGenerations
    }

    /// Reads a request `body` for this route, as JSON. Audio takes `file` as an http(s) URL or
    /// an upload key. Streams are refused: a batch's answers are written to its output file;
    /// so are images as base64 (each image is named by URL there, its PNG stays in storage).
    pub fn request(self, body: &Value) -> Result<Request, OpenAiError> {
        let request = match self {
            Route::Transcriptions | Route::Translations => {
                let task = if self == Route::Transcriptions { "transcribe" } else { "translate" };
                let (options, file) = Transcription::from_json(body, task)?;
                Request::Audio(options, file)
            }
            Route::Embeddings => Request::Embeddings(Embeddings::parse(body)?),
            Route::ChatCompletions => Request::Completion(Completion::parse(body, Flavour::Chat)?),
            Route::Completions => Request::Completion(Completion::parse(body, Flavour::Text)?),
            Route::ImageGenerations => {
                let request = ImageGeneration::parse(body)?;
                if request.b64_json {
                    return Err(OpenAiError::unsupported(
                        "response_format",
                        "a batch's output file names each image by URL (its PNG stays in storage): response_format must be url",
                    ));
                }
                Request::Image(request)
            }
        };
        let streams = match &request {
            Request::Audio(options, _) => options.stream(),
            Request::Completion(c) => c.stream(),
            Request::Embeddings(_) | Request::Image(_) => false,
        };
        if streams {
            return Err(OpenAiError::unsupported("stream", "a batch writes its answers to its output file: stream must be false"));
        }
        Ok(request)
    }
}

/// A request read from JSON.
pub enum Request {
    /// The options and the file reference.
    Audio(Transcription, Value),
    Embeddings(Embeddings),
    Completion(Completion),
    Image(ImageGeneration),
}

impl Request {
    /// The job it runs as (`POST /v1/jobs`'s body).
    pub fn job_request(&self) -> Value {
        match self {
            Request::Audio(options, file) => options.job_request(file.clone()),
            Request::Embeddings(e) => e.job_request(),
            Request::Completion(c) => c.job_request(),
            Request::Image(i) => i.job_request(),
        }
    }

    /// OpenAI's answer, from the finished job's output.
    pub fn response(&self, job: &Job, output: &Value) -> Result<Value, OpenAiError> {
        match self {
            Request::Audio(options, _) => Ok(options.response_value(output)),
            Request::Embeddings(e) => e.response(job, output),
            Request::Completion(c) => Ok(c.response(job, output)),
            Request::Image(_) => Ok(super::images::url_response(job, output)),
        }
    }
}
