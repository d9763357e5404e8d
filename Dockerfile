# tablemail in a container: configure it with TABLEMAIL__* environment
# variables (or mount a file and pass --config), e.g.
#
#   docker build -t tablemail .
#   docker run -e TABLEMAIL__DATABASE__URL=postgres://tablemail@db/app \
#              -e TABLEMAIL__TRANSPORT__URL='smtp://relay:587?tls=required' \
#              -e TABLEMAIL__TRANSPORT__USERNAME=tablemail \
#              -e TABLEMAIL__TRANSPORT__PASSWORD_FILE=/run/secrets/smtp-password \
#              -e TABLEMAIL__DEFAULTS__FROM_ADDRESS=noreply@example.com tablemail

FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY .cargo ./.cargo
COPY src ./src
COPY migrations ./migrations
COPY benches ./benches
RUN cargo build --release --locked --bin tablemail

FROM debian:bookworm-slim
# CA certificates to verify the relay's; nothing else.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/tablemail --create-home tablemail
COPY --from=build /src/target/release/tablemail /usr/local/bin/tablemail
USER 10001:10001
WORKDIR /var/lib/tablemail
ENV TABLEMAIL__LOG__FORMAT=json \
    TABLEMAIL__METRICS__LISTEN=0.0.0.0:9898
EXPOSE 9898
# /healthz answers 200 while the database and the relay are reachable.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9898 && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/tablemail"]
CMD ["run"]
