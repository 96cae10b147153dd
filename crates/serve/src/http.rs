//! The HTTP face: routes, request parsing, admission to the bounded queue, timeouts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::worker::{Job, Reply, Request};
use crate::{Shared, HTTP_STACK_BYTES};

/// Runs the HTTP server on `listener` until `stop` fires, then until every accepted request is
/// answered.
pub(crate) fn run(
    shared: Arc<Shared>,
    listener: std::net::TcpListener,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<(), String> {
    // Two threads: handlers only parse bodies (on blocking threads) and wait; the batch runs on
    // its own thread with the kernel threads.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_stack_size(HTTP_STACK_BYTES)
        .thread_name("tumble-serve-io")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the HTTP runtime: {e}"))?;
    let drain = Arc::clone(&shared);
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/models/{*rest}", get(model_status).post(predict))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            refuse_declared_oversize,
        ))
        .with_state(shared);
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| format!("cannot listen: {e}"))?;
        let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
        let (headers, writes) = (drain.config.header_timeout, drain.config.timeout);
        let serve = serve_connections(listener, app, headers, writes, async move {
            let _ = stop.await;
            let _ = stopping_tx.send(());
        });
        // The graceful shutdown waits for every connection to close, and one that never
        // finishes sending its request never does (SIGTERM did not end the server: an audit's
        // find). Once every accepted instance is answered, connections get a moment more; and
        // the wait is never longer than a request's own time limit.
        let bounded = async move {
            if stopping_rx.await.is_err() {
                return std::future::pending::<()>().await;
            }
            let limit = Instant::now() + drain.config.timeout + DRAIN_GRACE;
            let mut quiet_since: Option<Instant> = None;
            while Instant::now() < limit {
                if drain.outstanding.load(Ordering::SeqCst) == 0
                    && drain.parsing.load(Ordering::SeqCst) == 0
                {
                    let since = *quiet_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= DRAIN_GRACE {
                        return;
                    }
                } else {
                    quiet_since = None;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            () = serve => {}
            () = bounded => {}
        }
        Ok(())
    })
}

/// Accepts connections and serves each with hyper until `stop` completes; then stops accepting
/// (new connections are refused), lets every open connection finish the request it is on, and
/// returns once all are closed. Unlike `axum::serve`, each connection has a timer: one that does
/// not send a request's headers within `header_timeout` (an idle keep-alive one included) is
/// closed, where a client that sent part of its headers and stopped held its connection forever.
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: std::time::Duration,
    write_timeout: std::time::Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    // Every connection's task holds a sender: once all are dropped, every connection is closed.
    let (open_tx, mut open_rx) = tokio::sync::mpsc::channel::<()>(1);
    let mut stop = std::pin::pin!(stop);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // The peer gave up before it was accepted: nothing to serve.
                Err(e) if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                ) => continue,
                // Out of file descriptors or memory: retry later rather than spin (as axum does).
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let stream = WriteDeadline::new(
            crate::parse_errors::ParseErrorBodies::new(stream),
            write_timeout,
        );
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut closing = closing_rx.clone();
        let open = open_tx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            // (hyper's default `half_close(false)` kept on purpose: the end of the client's side
            // is how a client that went away is seen — its request's instances are cancelled —
            // so one that half-closes after sending (`nc -N`) is taken for gone too.)
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = async { closing.wait_for(|c| *c).await.is_ok() } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(open);
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    drop(open_tx);
    let _ = open_rx.recv().await;
}

/// A connection whose writes must make progress: a write or flush that waits longer than its
/// limit for the client to read fails (`TimedOut`), and hyper closes the connection. A client
/// that sent a request and never read the answer held the connection, and what was left of the
/// answer, for as long as it liked.
struct WriteDeadline<S> {
    inner: S,
    limit: std::time::Duration,
    /// Running while a write waits for the client; dropped when one makes progress.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, limit: std::time::Duration) -> Self {
        WriteDeadline {
            inner,
            limit,
            stalled: None,
        }
    }

    /// `r`, the inner write's outcome, with the stall clock run (started, checked or stopped).
    fn watch<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::future::Future;
        use std::task::Poll;
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let limit = self.limit;
        let clock = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match clock.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client read nothing of the answer within --timeout-ms",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// How long connections may stay open once shutdown has answered everything accepted.
const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Seconds a client told 503 (queue full, memory held by other requests) or 429 may wait before
/// trying again (`Retry-After`): about a batch's time, not a promise.
const RETRY_AFTER_SECONDS: &str = "1";

fn json_response(status: StatusCode, body: String) -> Response {
    let mut response = (status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
    if matches!(
        status,
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
    ) {
        response.headers_mut().insert(
            header::RETRY_AFTER,
            header::HeaderValue::from_static(RETRY_AFTER_SECONDS),
        );
    }
    response
}

fn error(status: StatusCode, message: &str) -> Response {
    // A located run error is rendered as a diagnostic, which begins `error: `: under the
    // `error` key that said it twice.
    let message = message.trim_end();
    let message = message.strip_prefix("error: ").unwrap_or(message);
    json_response(status, serde_json::json!({ "error": message }).to_string())
}

/// `response` with its `Allow` header set to `methods`.
fn allowing(mut response: Response, methods: &'static str) -> Response {
    response
        .headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static(methods));
    response
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "no such route; try POST /v1/models/{name}:predict, GET /v1/models/{name}, /healthz, \
         /readyz or /metrics",
    )
}

/// A known route asked with a method it does not take: JSON, as every other error (axum's own
/// 405 had an empty body), with the `Allow` of that path (the route's own listed GET, HEAD and
/// POST for the prediction path too). A model path naming another model is a 404, whatever the
/// method.
async fn wrong_method(
    State(s): State<Arc<Shared>>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    // The model path as the router decoded it for the handlers; the other routes have none.
    let allow = match uri.path().starts_with("/v1/models/") {
        true => {
            let rest = match model_path(path) {
                Ok(r) => r,
                Err(m) => return error(StatusCode::BAD_REQUEST, &m),
            };
            let (name, predict) = match rest.strip_suffix(":predict") {
                Some(name) => (name, true),
                None => (rest.as_str(), false),
            };
            if name != s.config.name {
                return unknown_model(&s, name);
            }
            if predict {
                "POST"
            } else {
                "GET, HEAD"
            }
        }
        false => "GET, HEAD",
    };
    allowing(
        error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!(
                "{method} {}: not taken here; predictions are POSTed to \
                 /v1/models/{{name}}:predict, and /v1/models/{{name}}, /healthz, /readyz and \
                 /metrics answer GET",
                tumble_io::echo(uri.path())
            ),
        ),
        allow,
    )
}

/// The `{*rest}` of `/v1/models/..`, or the message of a JSON 400 where it is not UTF-8 once
/// percent-decoded (axum's own answer was plain text).
fn model_path(
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<String, String> {
    path.map(|Path(rest)| rest)
        .map_err(|e| format!("the URL's model path: {}", e.body_text()))
}

/// Counts a request while its body is parsed (see `Shared::parsing`).
struct Parsing<'s>(&'s Shared);

impl<'s> Parsing<'s> {
    fn new(s: &'s Shared) -> Self {
        s.parsing.fetch_add(1, Ordering::SeqCst);
        Parsing(s)
    }
}

impl Drop for Parsing<'_> {
    fn drop(&mut self) {
        self.0.parsing.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request whose `Content-Length` already says it is past `--max-body` is answered 413 before
/// any of its body is read (it waited for the body's first byte: a client that declared a huge
/// body and sent nothing held its connection).
async fn refuse_declared_oversize(
    State(s): State<Arc<Shared>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > s.config.max_body_bytes as u64) {
        return body_too_large(&s);
    }
    // One the memory budget could never parse is refused before it is read: each connection
    // could otherwise hold up to --max-body of it meanwhile, outside the budget.
    if let Some(n) = declared.filter(|&n| tumble_io::body_never_fits(n)) {
        s.metrics
            .response(StatusCode::PAYLOAD_TOO_LARGE.as_u16(), 0.0);
        return never_parses(&format!("({n} bytes)"));
    }
    next.run(req).await
}

/// 413 for a body declared past `--max-body`, counted (the middleware's; `predict` counts its
/// own answers).
fn body_too_large(s: &Shared) -> Response {
    s.metrics
        .response(StatusCode::PAYLOAD_TOO_LARGE.as_u16(), 0.0);
    too_large(s)
}

/// 413 for a body past `--max-body` (declared so, or found so as it is read).
fn too_large(s: &Shared) -> Response {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!(
            "the request body is larger than this server takes ({} bytes, --max-body)",
            s.config.max_body_bytes
        ),
    )
}

/// 413 for a body (`size` says how large) that the memory budget could never parse.
fn never_parses(size: &str) -> Response {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!(
            "the request body {size} is too large to parse within this server's memory budget \
             (--max-memory); send fewer instances per request"
        ),
    )
}

/// `response`, closing its connection after it (the rest of the request's body is never read).
fn closing(mut response: Response) -> Response {
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

/// 503 for a request that shutdown caught before it was accepted.
fn shutting_down() -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "the server is shutting down",
    )
}

/// 408 for a body that did not arrive within the request's time limit.
fn body_timeout(s: &Shared) -> Response {
    closing(error(
        StatusCode::REQUEST_TIMEOUT,
        &format!(
            "the request body did not arrive within {} ms (--timeout-ms)",
            s.config.timeout.as_millis()
        ),
    ))
}

async fn readyz(State(s): State<Arc<Shared>>) -> Response {
    if s.stopping.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, "stopping\n").into_response()
    } else {
        (StatusCode::OK, "ready\n").into_response()
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics
            .render(&s.config.name, s.outstanding.load(Ordering::SeqCst) as u64),
    )
        .into_response()
}

fn unknown_model(s: &Shared, asked: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        &format!(
            "no model `{}` here; this server serves `{}`",
            tumble_io::echo(asked),
            s.config.name
        ),
    )
}

/// `GET /v1/models/{name}`: TF-Serving's model status, plus the signature.
async fn model_status(
    State(s): State<Arc<Shared>>,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    let rest = match model_path(path) {
        Ok(r) => r,
        Err(m) => return error(StatusCode::BAD_REQUEST, &m),
    };
    if rest.strip_suffix(":predict") == Some(s.config.name.as_str()) {
        return allowing(
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                &format!("GET /v1/models/{rest}: predictions are POSTed"),
            ),
            "POST",
        );
    }
    if rest != s.config.name {
        return unknown_model(&s, &rest);
    }
    let m = &s.model;
    let inputs: Vec<_> = m
        .inputs()
        .iter()
        .map(|(n, ty)| serde_json::json!({ "name": n, "type": ty.to_string() }))
        .collect();
    let params: Vec<_> = m
        .parameters()
        .iter()
        .map(|p| {
            serde_json::json!({ "name": p.name, "shape": p.shape, "dtype": p.dtype.to_string() })
        })
        .collect();
    let body = serde_json::json!({
        "name": s.config.name,
        "ready": !s.stopping.load(Ordering::SeqCst),
        "model_version_status": [{
            "version": "1",
            "state": "AVAILABLE",
            "status": { "error_code": "OK", "error_message": "" }
        }],
        "policy": s.config.policy.name(),
        "max_batch": s.config.max_batch,
        "inputs": inputs,
        "output": m.output_type().to_string(),
        "parameters": params,
    });
    json_response(StatusCode::OK, body.to_string())
}

/// `POST /v1/models/{name}:predict`.
async fn predict(
    State(s): State<Arc<Shared>>,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
    req: axum::extract::Request,
) -> Response {
    let start = Instant::now();
    let (status, response) = predict_inner(&s, path, req, start).await;
    s.metrics
        .response(status.as_u16(), start.elapsed().as_secs_f64());
    response
}

/// [`predict`]'s answer and its status (counted by the caller, whatever the answer).
async fn predict_inner(
    s: &Arc<Shared>,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
    req: axum::extract::Request,
    start: Instant,
) -> (StatusCode, Response) {
    let with_status = |r: Response| (r.status(), r);
    let rest = match model_path(path) {
        Ok(r) => r,
        Err(m) => return with_status(error(StatusCode::BAD_REQUEST, &m)),
    };
    // The request's time limit runs from its headers: a body that has not arrived by then is
    // answered 408 and its connection closed (a client that sent part of a body and stopped held
    // its connection, and up to --max-body of buffered bytes, for as long as it liked). One still
    // arriving when shutdown begins is answered 503 then (it was cut off with no answer).
    let shutdown = s.stop_notice.notified();
    tokio::pin!(shutdown);
    shutdown.as_mut().enable();
    if s.stopping.load(Ordering::SeqCst) {
        return with_status(closing(shutting_down()));
    }
    let deadline = tokio::time::Instant::from_std(start) + s.config.timeout;
    let body = tokio::select! {
        read = read_body(s, req.into_body(), deadline) => read,
        () = shutdown => return with_status(closing(shutting_down())),
    };
    // Shutdown waits for a request whose body is being parsed.
    let _parsing = Parsing::new(s);
    let body = match body {
        Ok(b) => b,
        Err(refused) => return with_status(refused),
    };
    let Some(asked) = rest.strip_suffix(":predict") else {
        if rest == s.config.name {
            return with_status(allowing(
                error(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &format!(
                        "POST /v1/models/{}: the model's status answers GET; predictions are \
                         POSTed to /v1/models/{}:predict",
                        tumble_io::echo(&rest),
                        tumble_io::echo(&rest)
                    ),
                ),
                "GET, HEAD",
            ));
        }
        return with_status(error(
            StatusCode::NOT_FOUND,
            &format!(
                "POST /v1/models/{}: the only verb is `:predict`",
                tumble_io::echo(&rest)
            ),
        ));
    };
    if asked != s.config.name {
        return with_status(unknown_model(s, asked));
    }
    answer(s, body, start).await
}

/// The request's body, read frame by frame, each frame's bytes checked before they are kept (the
/// one place `--max-body` is enforced on a body being read; no axum extractor reads bodies):
/// past `--max-body`, or once the text read so far could never be parsed within the budget,
/// 413; when the budget has no room for the next frame now (other requests' bodies and batches
/// hold it), 503 to retry; not all arrived by `deadline`, 408. A chunked body's length is
/// unknown until read: collected whole, each connection held up to `--max-body` outside the
/// budget's checks, and many at once could take the process past it. Errors are JSON like
/// every other (not axum's text).
async fn read_body(
    s: &Shared,
    mut body: axum::body::Body,
    deadline: tokio::time::Instant,
) -> Result<Bytes, Response> {
    use http_body_util::BodyExt;
    let limit = s.config.max_body_bytes;
    let mut kept: Vec<u8> = Vec::new();
    let refusal = loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(body_timeout(s)),
            Ok(None) => return Ok(Bytes::from(kept)),
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(e))) => {
                return Err(closing(error(
                    StatusCode::BAD_REQUEST,
                    &format!("the request body could not be read: {e}"),
                )))
            }
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers: nothing of the body
        };
        let len = kept.len().saturating_add(data.len());
        if len > limit {
            break too_large(s);
        }
        if tumble_io::body_never_fits(len as u64) {
            break never_parses(&format!(
                "(more than {} so far)",
                tumble_limits::bytes_text(kept.len())
            ));
        }
        // Room for the frame, and for the buffer's doubling as it grows.
        let growth = if kept.capacity() < len {
            len.max(2 * kept.capacity())
        } else {
            0
        };
        if let Err(stop) = tumble_limits::reserve(growth) {
            break error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("the request body cannot be held now: {stop}; try again later"),
            );
        }
        kept.extend_from_slice(&data);
    };
    drop(kept);
    // The rest is read and dropped (until the deadline) before the answer: closing a connection
    // with unread bytes resets it, and the client could lose the answer with them.
    let _ = tokio::time::timeout_at(deadline, async {
        while let Some(Ok(_)) = body.frame().await {}
    })
    .await;
    Err(closing(refusal))
}

/// Sets its flag when dropped: the handler's future is dropped when its client disconnects.
/// (Set after an answer too, when nothing of the request runs any more.)
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Bodies from this size on parse one at a time (see `answer`).
const LARGE_BODY_BYTES: usize = 1 << 20;

async fn answer(s: &Arc<Shared>, body: Bytes, start: Instant) -> (StatusCode, Response) {
    let fail = |status: StatusCode, message: &str| (status, error(status, message));
    // Deep bodies parse by native recursion: on a blocking thread with a big stack, off the
    // threads that accept connections. A parsed body is tens of times its text, built at once:
    // large ones parse one at a time, each only if the memory budget has room for it (four
    // 63 MiB bodies at once took 14 GB under a 2 GiB budget).
    let shared = Arc::clone(s);
    let parsed = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = (body.len() >= LARGE_BODY_BYTES)
            .then(|| shared.large_parse.lock().unwrap_or_else(|e| e.into_inner()));
        tumble_io::read_request_instances_at_most(
            &body,
            "instances",
            "request",
            shared.config.max_queue,
            " (--max-queue)",
        )
    })
    .await;
    if s.stopping.load(Ordering::SeqCst) {
        // Shutdown began while the body was parsed: the worker may be gone already.
        return (StatusCode::SERVICE_UNAVAILABLE, shutting_down());
    }
    let instances = match parsed {
        Ok(Ok(i)) => i,
        Ok(Err(e @ tumble_io::IoError::TooLarge { .. })) => {
            return fail(StatusCode::PAYLOAD_TOO_LARGE, &e.to_string())
        }
        // Other requests hold the memory it needs: retry later (a 413 said it never fits).
        Ok(Err(e @ tumble_io::IoError::NoRoomNow { .. })) => {
            return fail(StatusCode::SERVICE_UNAVAILABLE, &e.to_string())
        }
        Ok(Err(e)) => return fail(StatusCode::BAD_REQUEST, &e.to_string()),
        Err(_) => {
            return fail(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal: reading the request failed",
            )
        }
    };
    let n = instances.len();
    if n == 0 {
        return (
            StatusCode::OK,
            json_response(StatusCode::OK, "{\"predictions\":[]}".into()),
        );
    }
    let max_queue = s.config.max_queue;
    if n > max_queue {
        return fail(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("the request has {n} instances; this server takes at most {max_queue} at once (--max-queue)"),
        );
    }
    let before = s.outstanding.fetch_add(n, Ordering::SeqCst);
    if before + n > max_queue {
        s.outstanding.fetch_sub(n, Ordering::SeqCst);
        return fail(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("the queue is full ({before} of {max_queue} instances waiting or running); retry later"),
        );
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let cancelled = Arc::new(AtomicBool::new(false));
    // Dropped with this future (the client went away) or on its timeout: the request's running
    // instances stop mid-step.
    let _cancel_on_drop = CancelOnDrop(Arc::clone(&cancelled));
    if s.jobs
        .send(Job::Predict(Request {
            instances,
            reply: tx,
            cancelled,
        }))
        .is_err()
    {
        s.outstanding.fetch_sub(n, Ordering::SeqCst);
        return fail(
            StatusCode::SERVICE_UNAVAILABLE,
            "the batch thread has stopped",
        );
    }
    let left = s.config.timeout.saturating_sub(start.elapsed());
    // Dropping `rx` (timeout here, or the whole future when the client disconnects) tells the
    // worker to drop the request's instances.
    match tokio::time::timeout(left, rx).await {
        Ok(Ok(Reply::Predictions(preds))) => {
            let mut body =
                String::with_capacity(preds.iter().map(|p| p.len() + 1).sum::<usize>() + 20);
            body.push_str("{\"predictions\":[");
            // Each prediction let go once copied: the answer and its parts were held twice over
            // (a 738 MB answer peaked 0.8 GB past the run's own memory).
            for (k, p) in preds.into_iter().enumerate() {
                if k > 0 {
                    body.push(',');
                }
                body.push_str(&p);
            }
            body.push_str("]}");
            (StatusCode::OK, json_response(StatusCode::OK, body))
        }
        Ok(Ok(Reply::Error { status, message })) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            fail(status, &message)
        }
        // Dropped unanswered while this handler waits: the batch threads let go of the channel
        // after shutdown's last look at it (a request sent in between), or one failed. Either
        // way no batch thread counted the request out (they do so only as they answer).
        Ok(Err(_)) => {
            s.outstanding.fetch_sub(n, Ordering::SeqCst);
            match s.stopping.load(Ordering::SeqCst) {
                true => (StatusCode::SERVICE_UNAVAILABLE, shutting_down()),
                false => fail(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal: the batch thread dropped the request",
                ),
            }
        }
        Err(_) => fail(
            StatusCode::GATEWAY_TIMEOUT,
            &format!(
                "no answer within {} ms (--timeout-ms); the request's instances were dropped",
                s.config.timeout.as_millis()
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A write the other side never reads fails once its limit passes; one it reads, however
    /// slowly, completes (each read is progress and starts the clock again).
    #[test]
    fn writes_must_make_progress_within_their_limit() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let limit = Duration::from_millis(50);
            let (a, _unread) = tokio::io::duplex(64);
            let mut w = WriteDeadline::new(a, limit);
            let t0 = Instant::now();
            let e = w.write_all(&[7u8; 1000]).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
            assert!(t0.elapsed() >= limit, "{:?}", t0.elapsed());

            let (a, mut b) = tokio::io::duplex(64);
            let reader = tokio::spawn(async move {
                let (mut got, mut buf) = (0, [0u8; 64]);
                loop {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    match b.read(&mut buf).await.unwrap() {
                        0 => return got,
                        n => got += n,
                    }
                }
            });
            let mut w = WriteDeadline::new(a, limit);
            w.write_all(&[7u8; 1000]).await.unwrap();
            w.shutdown().await.unwrap();
            drop(w);
            assert_eq!(reader.await.unwrap(), 1000);
        });
    }
}
