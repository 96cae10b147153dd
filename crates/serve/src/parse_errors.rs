//! Bodies for the answers hyper gives on its own. A request hyper cannot parse — a malformed
//! request line or header, a bad `Content-Length` or chunk size, a target or header section past
//! its buffer — never reaches a route: hyper answers 400, 414 or 431 itself, with
//! `content-length: 0` and `connection: close`, and the client learns nothing of what was wrong.
//! Every other error of the server is JSON with an `error` message, so these are too: the
//! connection's writes are watched for exactly such an answer (the status line of one of the three
//! at the start of a write that is one empty-bodied response head) and it goes out with a JSON
//! body saying what to fix instead. The routes never answer these statuses with an empty body
//! (theirs always carry JSON), so nothing of theirs is touched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The statuses hyper answers by itself, with what the client should know of each.
const OWN_ANSWERS: [(&[u8], &str); 3] = [
    (
        b"HTTP/1.1 400 Bad Request\r\n",
        "the request is not valid HTTP/1.1: a malformed request line or header, an invalid \
         Content-Length, or a malformed chunked body; send `METHOD /path HTTP/1.1`, then \
         `Name: value` header lines, a blank line, and a body framed by Content-Length or \
         chunked transfer encoding",
    ),
    (
        b"HTTP/1.1 414 URI Too Long\r\n",
        "the request's target (path and query) is too long; the routes are POST \
         /v1/models/{name}:predict, GET /v1/models/{name}, /healthz, /readyz and /metrics",
    ),
    (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
        "the request's header section is too large (more than 100 headers, or past the \
         server's header buffer of about 400 KiB); send fewer or shorter headers",
    ),
];

/// `head` with a JSON body in place of its empty one, if `head` is one of hyper's own empty
/// answers ([`OWN_ANSWERS`]): the whole of `head` one response head (its status line one of
/// theirs, ending at its blank line, `content-length: 0` among its headers).
fn with_body(head: &[u8]) -> Option<Vec<u8>> {
    let (status, message) = OWN_ANSWERS
        .iter()
        .find(|(status, _)| head.starts_with(status))?;
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    if end != head.len() {
        return None;
    }
    let fields = head.get(status.len()..end - 2)?;
    let lines: Vec<&[u8]> = fields
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    let empty = |l: &&[u8]| l.eq_ignore_ascii_case(b"content-length: 0\r");
    if !lines.iter().any(empty) {
        return None;
    }
    let body = serde_json::json!({ "error": message }).to_string();
    let mut out = status.to_vec();
    for l in lines.iter().filter(|l| !empty(l)) {
        out.extend_from_slice(l);
        out.push(b'\n');
    }
    out.extend_from_slice(b"content-type: application/json\r\n");
    out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

/// A connection whose writes of hyper's own empty error answers get a JSON body (see the
/// module's comment): such an answer is the whole of a write, or the one non-empty buffer of a
/// vectored write (hyper queues a response's head and body as buffers of their own).
pub(crate) struct ParseErrorBodies<S> {
    inner: S,
    /// A rewritten answer still to send, and how much of it went.
    pending: Option<(Vec<u8>, usize)>,
}

impl<S> ParseErrorBodies<S> {
    pub(crate) fn new(inner: S) -> Self {
        ParseErrorBodies {
            inner,
            pending: None,
        }
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> ParseErrorBodies<S> {
    /// Sends what is left of a rewritten answer; ready once it is all out.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, sent)) = &mut self.pending {
            let Some(rest) = bytes.get(*sent..).filter(|r| !r.is_empty()) else {
                self.pending = None;
                break;
            };
            match Pin::new(&mut self.inner).poll_write(cx, rest) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *sent += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for ParseErrorBodies<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for ParseErrorBodies<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.drain(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        }
        if let Some(answer) = with_body(buf) {
            // Taken whole: what hyper wrote is answered, the rewritten bytes go out from here
            // (what does not go at once, on hyper's flush or shutdown).
            self.pending = Some((answer, 0));
            if let Poll::Ready(Err(e)) = self.drain(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut filled = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(only), None) = (filled.next(), filled.next()) {
            if with_body(only).is_some() {
                return self.poll_write(cx, only);
            }
        }
        match self.drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.inner).poll_write_vectored(cx, bufs),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.inner).poll_flush(cx),
            other => other,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut self.inner).poll_shutdown(cx),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const HYPER_400: &[u8] =
        b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\n";

    #[test]
    fn only_empty_own_answers_get_a_body() {
        let answer = with_body(HYPER_400).unwrap();
        let text = String::from_utf8(answer).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
        assert!(head.contains("\r\ncontent-type: application/json\r\n"));
        assert!(!head.contains("content-length: 0\r\n"), "{head}");
        assert!(
            head.ends_with(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(v["error"].as_str().unwrap().contains("not valid HTTP/1.1"));
        for status in ["414 URI Too Long", "431 Request Header Fields Too Large"] {
            let head =
                format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            let out = String::from_utf8(with_body(head.as_bytes()).unwrap()).unwrap();
            assert!(out.contains("\"error\""), "{out}");
        }
        // A route's own 400 (with a body), a head followed by more bytes, another status, a 400
        // that does not say its body is empty, a split head: left as they are.
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n";
        assert_eq!(with_body(ours), None);
        let mut more = HYPER_400.to_vec();
        more.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        assert_eq!(with_body(&more), None);
        assert_eq!(
            with_body(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"),
            None
        );
        assert_eq!(
            with_body(b"HTTP/1.1 400 Bad Request\r\ntransfer-encoding: chunked\r\n\r\n"),
            None
        );
        assert_eq!(with_body(&HYPER_400[..20]), None);
    }

    /// Through the stream: the rewritten answer arrives whole however slowly the client reads,
    /// other bytes pass unchanged, and a shutdown sends what was pending first.
    #[test]
    fn the_stream_sends_the_answer_whole() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let (a, mut b) = tokio::io::duplex(16);
            let reader = tokio::spawn(async move {
                let mut got = Vec::new();
                b.read_to_end(&mut got).await.unwrap();
                got
            });
            let mut w = ParseErrorBodies::new(a);
            w.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            let n = w.write(HYPER_400).await.unwrap();
            assert_eq!(n, HYPER_400.len());
            let slices = [io::IoSlice::new(b""), io::IoSlice::new(HYPER_400)];
            let n = w.write_vectored(&slices).await.unwrap();
            assert_eq!(n, HYPER_400.len());
            w.shutdown().await.unwrap();
            drop(w);
            let got = String::from_utf8(reader.await.unwrap()).unwrap();
            let answer = String::from_utf8(with_body(HYPER_400).unwrap()).unwrap();
            let expected =
                format!("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok{answer}{answer}");
            assert_eq!(got, expected);
        });
    }
}
