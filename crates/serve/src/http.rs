//! The HTTP face: routes, request parsing, admission to the bounded queue, timeouts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
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
    let limit = shared.config.max_body_bytes;
    let drain = Arc::clone(&shared);
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/models/{*rest}", get(model_status).post(predict))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            refuse_declared_oversize,
        ))
        .with_state(shared);
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| format!("cannot listen: {e}"))?;
        let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
        let serve = serve_connections(listener, app, drain.config.header_timeout, async move {
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
                if drain.outstanding.load(Ordering::SeqCst) == 0 {
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
            r = serve => r.map_err(|e| format!("the HTTP server failed: {e}")),
            () = bounded => Ok(()),
        }
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
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
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
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut closing = closing_rx.clone();
        let open = open_tx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
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
    Ok(())
}

/// How long connections may stay open once shutdown has answered everything accepted.
const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

fn json_response(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn error(status: StatusCode, message: &str) -> Response {
    json_response(
        status,
        serde_json::json!({ "error": message.trim_end() }).to_string(),
    )
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "no such route; try POST /v1/models/{name}:predict, GET /v1/models/{name}, /healthz, \
         /readyz or /metrics",
    )
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
    next.run(req).await
}

/// 413 for a body past `--max-body` (declared so, or found so as it is read), counted.
fn body_too_large(s: &Shared) -> Response {
    s.metrics
        .response(StatusCode::PAYLOAD_TOO_LARGE.as_u16(), 0.0);
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!(
            "the request body is larger than this server takes ({} bytes, --max-body)",
            s.config.max_body_bytes
        ),
    )
}

/// 408 for a body that did not arrive within the request's time limit, counted; the connection
/// is closed (the rest of the body is never read).
fn body_timeout(s: &Shared) -> Response {
    let status = StatusCode::REQUEST_TIMEOUT;
    s.metrics
        .response(status.as_u16(), s.config.timeout.as_secs_f64());
    let mut response = error(
        status,
        &format!(
            "the request body did not arrive within {} ms (--timeout-ms)",
            s.config.timeout.as_millis()
        ),
    );
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
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
        s.metrics.render(&s.config.name),
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
async fn model_status(State(s): State<Arc<Shared>>, Path(rest): Path<String>) -> Response {
    if rest.strip_suffix(":predict") == Some(s.config.name.as_str()) {
        let mut r = error(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("GET /v1/models/{rest}: predictions are POSTed"),
        );
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("POST"));
        return r;
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
    Path(rest): Path<String>,
    req: axum::extract::Request,
) -> Response {
    use axum::extract::FromRequest;
    // The request's time limit runs from its headers: a body that has not arrived by then is
    // answered 408 and its connection closed (a client that sent part of a body and stopped held
    // its connection, and up to --max-body of buffered bytes, for as long as it liked).
    let start = Instant::now();
    let body = match tokio::time::timeout(s.config.timeout, Bytes::from_request(req, &())).await {
        Ok(body) => body,
        Err(_) => return body_timeout(&s),
    };
    // A body past --max-body (or one that could not be read) is answered in JSON like every
    // other error, not axum's plain text.
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            let status = e.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                return body_too_large(&s);
            }
            s.metrics.response(status.as_u16(), 0.0);
            return error(status, &e.body_text());
        }
    };
    let Some(asked) = rest.strip_suffix(":predict") else {
        return error(
            StatusCode::NOT_FOUND,
            &format!(
                "POST /v1/models/{}: the only verb is `:predict`",
                tumble_io::echo(&rest)
            ),
        );
    };
    if asked != s.config.name {
        return unknown_model(&s, asked);
    }
    let (status, response) = answer(&s, body, start).await;
    s.metrics
        .response(status.as_u16(), start.elapsed().as_secs_f64());
    response
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
    if s.stopping.load(Ordering::SeqCst) {
        return fail(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        );
    }
    // Deep bodies parse by native recursion: on a blocking thread with a big stack, off the
    // threads that accept connections. A parsed body is tens of times its text, built at once:
    // large ones parse one at a time, each only if the memory budget has room for it (four
    // 63 MiB bodies at once took 14 GB under a 2 GiB budget).
    let shared = Arc::clone(s);
    let parsed = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = (body.len() >= LARGE_BODY_BYTES)
            .then(|| shared.large_parse.lock().unwrap_or_else(|e| e.into_inner()));
        tumble_io::read_request_instances(&body, "instances", "request")
    })
    .await;
    let instances = match parsed {
        Ok(Ok(i)) => i,
        Ok(Err(e @ tumble_io::IoError::TooLarge { .. })) => {
            return fail(StatusCode::PAYLOAD_TOO_LARGE, &e.to_string())
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
            for (k, p) in preds.iter().enumerate() {
                if k > 0 {
                    body.push(',');
                }
                body.push_str(p);
            }
            body.push_str("]}");
            (StatusCode::OK, json_response(StatusCode::OK, body))
        }
        Ok(Ok(Reply::Error { status, message })) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            fail(status, &message)
        }
        Ok(Err(_)) => fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal: the batch thread dropped the request",
        ),
        Err(_) => fail(
            StatusCode::GATEWAY_TIMEOUT,
            &format!(
                "no answer within {} ms (--timeout-ms); the request's instances were dropped",
                s.config.timeout.as_millis()
            ),
        ),
    }
}
