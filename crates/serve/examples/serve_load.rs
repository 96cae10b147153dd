//! Open-loop load generator for `tumble serve` (used by `bench/serve_load.py`).
//!
//! Requests (one instance each, drawn from a JSON Lines file) arrive as a Poisson process at a
//! fixed rate, each on its own connection, whether or not earlier ones were answered (open loop:
//! a closed-loop client slows down with the server and hides its queueing). Latency is measured
//! from each request's scheduled arrival, so a late-running generator does not flatter the server.
//!
//!     serve_load ADDR NAME INSTANCES.jsonl RATE SECONDS SEED [MAX_REQUESTS]
//!
//! Prints one JSON object: counts, throughput and latency percentiles (ms).

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// xorshift64*: the generator needs only reproducible uniform draws.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

async fn request(addr: &str, head: &str, body: &str) -> Result<u16, String> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let _ = s.set_nodelay(true);
    let msg = format!("{head}{body}");
    s.write_all(msg.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::with_capacity(1024);
    s.read_to_end(&mut buf).await.map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| "no status line".to_string())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let k = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[k.min(sorted.len() - 1)]
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 7 {
        return Err(
            "usage: serve_load ADDR NAME INSTANCES.jsonl RATE SECONDS SEED [MAX_REQUESTS]".into(),
        );
    }
    let addr = args[1].clone();
    let name = &args[2];
    let text = std::fs::read_to_string(&args[3]).map_err(|e| format!("{}: {e}", args[3]))?;
    let instances: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(String::from)
        .collect();
    let rate: f64 = args[4].parse().map_err(|_| "RATE: a number")?;
    let seconds: f64 = args[5].parse().map_err(|_| "SECONDS: a number")?;
    let seed: u64 = args[6].parse().map_err(|_| "SEED: an integer")?;
    let max_requests: usize = match args.get(7) {
        Some(s) => s.parse().map_err(|_| "MAX_REQUESTS: an integer")?,
        None => usize::MAX,
    };
    if instances.is_empty() || rate <= 0.0 {
        return Err("no instances, or a rate that is not positive".into());
    }
    // The schedule: exponential gaps, instances drawn uniformly.
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut t = 0.0;
    let mut schedule = Vec::new();
    while schedule.len() < max_requests {
        t += -rng.uniform().ln() / rate;
        if t > seconds {
            break;
        }
        let k = ((rng.uniform() * instances.len() as f64) as usize).min(instances.len() - 1);
        schedule.push((t, k));
    }
    let bodies: Vec<String> = instances
        .iter()
        .map(|i| format!("{{\"instances\":[{i}]}}"))
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let results = rt.block_on(async {
        let start = Instant::now();
        let mut tasks = Vec::with_capacity(schedule.len());
        for (at, k) in schedule {
            let due = start + Duration::from_secs_f64(at);
            tokio::time::sleep_until(due.into()).await;
            let body = bodies[k].clone();
            let head = format!(
                "POST /v1/models/{name}:predict HTTP/1.1\r\nHost: load\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n",
                body.len()
            );
            let addr = addr.clone();
            tasks.push(tokio::spawn(async move {
                let r = request(&addr, &head, &body).await;
                (r, due.elapsed().as_secs_f64(), Instant::now(), at)
            }));
        }
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            if let Ok(r) = t.await {
                out.push(r);
            }
        }
        (out, start)
    });
    let (results, start) = results;
    let sent = results.len();
    let mut lat: Vec<f64> = Vec::new();
    let mut errors = 0usize;
    let mut codes = std::collections::BTreeMap::<String, usize>::new();
    let mut last = start;
    // With SERVE_LOAD_TRACE=FILE, one line per request: scheduled arrival (s), latency (ms),
    // status — to see when a tail happens, not only how long it is.
    if let Ok(path) = std::env::var("SERVE_LOAD_TRACE") {
        let lines: String = results
            .iter()
            .map(|(r, secs, _, at)| {
                let code = r
                    .as_ref()
                    .map(|c| c.to_string())
                    .unwrap_or_else(|_| "io".into());
                format!("{at:.6} {:.3} {code}\n", secs * 1000.0)
            })
            .collect();
        std::fs::write(&path, lines).map_err(|e| format!("{path}: {e}"))?;
    }
    for (r, secs, done, _) in &results {
        match r {
            Ok(200) => {
                lat.push(secs * 1000.0);
                last = last.max(*done);
            }
            Ok(c) => {
                errors += 1;
                *codes.entry(c.to_string()).or_default() += 1;
            }
            Err(_) => {
                errors += 1;
                *codes.entry("io".into()).or_default() += 1;
            }
        }
    }
    lat.sort_by(f64::total_cmp);
    let span = last.duration_since(start).as_secs_f64().max(1e-9);
    let mean = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
    // JSON has no NaN: a statistic of no answered request is null.
    let num = |x: f64| {
        if x.is_finite() {
            format!("{x:.3}")
        } else {
            "null".into()
        }
    };
    println!(
        "{{\"rate\":{rate},\"sent\":{sent},\"ok\":{},\"errors\":{errors},\"codes\":{},\
         \"throughput\":{:.2},\"p50\":{},\"p90\":{},\"p99\":{},\"mean\":{},\"max\":{}}}",
        lat.len(),
        serde_json::to_string(&codes).unwrap_or_default(),
        lat.len() as f64 / span,
        num(percentile(&lat, 50.0)),
        num(percentile(&lat, 90.0)),
        num(percentile(&lat, 99.0)),
        num(if lat.is_empty() { f64::NAN } else { mean }),
        num(lat.last().copied().unwrap_or(f64::NAN)),
    );
    Ok(())
}
