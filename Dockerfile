# kvbus image: the static binary alone. Build it first with `make image`
# (CGO_ENABLED=0 go build into build/docker/), which then runs docker build;
# no base image is pulled.
FROM scratch
COPY kvbus /kvbus
# scratch has no /tmp: JetStream's data directory and temporary files need
# writable directories (mount a volume on /data to keep the request log).
COPY --chown=65532:65532 empty /tmp
COPY --chown=65532:65532 empty /data
ENV TMPDIR=/tmp
USER 65532:65532
VOLUME /data
EXPOSE 8000 9090 4222
# scratch has no shell or curl: the binary probes its own /healthz.
# The default command (serve) answers on :8000; other roles override it
# (schedulers and workers: --url http://127.0.0.1:9090/healthz).
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=3 CMD ["/kvbus", "healthcheck", "--url", "http://127.0.0.1:8000/healthz"]
ENTRYPOINT ["/kvbus"]
CMD ["serve", "--http-addr", ":8000", "--nats-addr", "0.0.0.0:4222", "--data-dir", "/data"]
