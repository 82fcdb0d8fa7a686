# syntax=docker/dockerfile:1
# One image for both tern binaries: `tern-api` (default command) and `tern-worker`.
# Used by docker-compose.yml; build alone with: docker build -t tern .

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# Cache mounts keep the crates registry and build artifacts between builds; the
# binaries are copied out of the (cached, unexported) target dir.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bins \
    && mkdir -p /out \
    && cp target/release/tern-api target/release/tern-worker /out/

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tern
COPY --from=build /out/tern-api /out/tern-worker /usr/local/bin/
USER tern
ENV TERN_LISTEN=0.0.0.0:8080
EXPOSE 8080
CMD ["tern-api"]
