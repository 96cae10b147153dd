//! A model's continuous-batching session (for a server): instances of many requests are admitted
//! one by one, join the running mini-batch at its next flush and leave it as soon as they are
//! done (see [`tumble_runtime::session`]). Results come out as JSON text in `tumble run`'s
//! encoding, errors located like [`Model::run`]'s, so what crosses threads is plain data.
//!
//! A `Session` holds interpreter values (`Rc`): it lives on one thread, which should have a large
//! stack ([`crate::with_big_stack`]) since instances are decoded there.

use std::collections::HashMap;

use tumble_interp::StopWhen;
use tumble_io::{encode_json, RawInstances, TypeEnv};
use tumble_runtime::session::{BatchSession, SessionStats};

use crate::{default_threads, instance_rng, Error, Model, RunOptions};

pub use tumble_runtime::session::Ticket;

/// See the module docs.
pub struct Session<'m> {
    model: &'m Model,
    env: TypeEnv<'m>,
    inner: BatchSession<'m>,
    seed: u64,
    /// Per admitted instance: how messages name it, and its index in its request.
    names: HashMap<Ticket, (String, usize)>,
}

impl Model {
    /// A continuous-batching session over this model. Of `opts`, `threads` (kernel threads),
    /// `seed` and `runtime` apply; instances are batched by how they are admitted, not by
    /// `batch` or `workers`.
    pub fn session(&self, opts: &RunOptions) -> Result<Session<'_>, Error> {
        let threads = match opts.threads {
            Some(0) => {
                return Err(Error::Usage {
                    message: "threads must be at least 1".into(),
                })
            }
            Some(t) => t,
            None => default_threads()?,
        };
        let mut runtime = self.runtime_options(opts.runtime);
        runtime.threads = threads;
        let exec = self.executable_for(&runtime);
        let inner = BatchSession::new(&self.program, &self.reuse, exec, &self.entry, runtime)
            .map_err(|e| Error::Usage {
                message: e.into_info().message,
            })?;
        Ok(Session {
            model: self,
            env: TypeEnv::new(&self.typed, &self.program),
            inner,
            seed: opts.seed,
            names: HashMap::new(),
        })
    }
}

impl<'m> Session<'m> {
    /// Launches from now on also use a share of the threads `lent` holds, which other sessions
    /// (a server's other batch threads) lend while they are idle ([`crate::Lending`]).
    pub fn lend_threads(&mut self, lent: &'m crate::Lending) {
        self.inner.lend_threads(lent);
    }

    /// Decodes instance `i` of `instances` and admits it; it draws random numbers from the stream
    /// `tumble run` gives instance `i` of a file, so a request's results equal `tumble run` on
    /// the same instances.
    pub fn admit(&mut self, instances: &RawInstances, i: usize) -> Result<Ticket, Error> {
        self.admit_until(instances, i, StopWhen::default())
    }

    /// [`Session::admit`] with when the instance is no longer wanted: its evaluation then stops
    /// with an error (see [`BatchSession::admit_until`]).
    pub fn admit_until(
        &mut self,
        instances: &RawInstances,
        i: usize,
        stop: StopWhen,
    ) -> Result<Ticket, Error> {
        let m = self.model;
        let values = crate::Decoding::new(m, self.env).decode_raw(instances, i)?;
        let args = m.bound.assemble(values).map_err(|e| Error::Input {
            instance: i,
            message: e.to_string(),
        })?;
        let ticket = self
            .inner
            .admit_until(args, instance_rng(self.seed, i), stop);
        let location = instances.items.get(i).map_or_else(
            || format!("instance {i}"),
            |it| format!("instance at {}", it.location),
        );
        self.names.insert(ticket, (location, i));
        Ok(ticket)
    }

    /// Drops an admitted instance (see [`BatchSession::cancel`]).
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        self.names.remove(&ticket);
        self.inner.cancel(ticket)
    }

    /// One step of the batch (see [`BatchSession::step`]): the instances that finished, each
    /// with its result as one line of JSON or its located error.
    pub fn step(&mut self) -> Vec<(Ticket, Result<String, Error>)> {
        let m = self.model;
        let finished = self.inner.step();
        let mut out = Vec::with_capacity(finished.len());
        for (ticket, result) in finished {
            let (location, i) = self
                .names
                .remove(&ticket)
                .unwrap_or_else(|| (format!("instance {}", ticket.0), 0));
            let result = match result {
                Ok(v) => encode_json(&v, &m.ret_ty, &self.env)
                    .map(|e| e.json)
                    .map_err(|e| Error::Output {
                        instance: i,
                        message: format!("{location}: {e}"),
                    }),
                Err(e) => Err(m.located_run_error(location, i, e)),
            };
            out.push((ticket, result));
        }
        out
    }

    /// Admitted instances that have not joined the batch yet.
    pub fn queued(&self) -> usize {
        self.inner.queued()
    }

    /// Instances in the running batch.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    pub fn is_idle(&self) -> bool {
        self.inner.is_idle()
    }

    /// Whether instances admitted now join at the next step (see
    /// [`BatchSession::accepting`]).
    pub fn accepting(&self) -> bool {
        self.inner.accepting()
    }

    /// Bounds the batch's dataflow graph (see [`BatchSession::max_nodes`]).
    pub fn set_max_nodes(&mut self, n: usize) {
        self.inner.max_nodes = n.max(1);
    }

    /// Depth levels launched per step (see [`BatchSession::levels_per_step`]); `None`: all.
    pub fn set_levels_per_step(&mut self, levels: Option<usize>) {
        self.inner.levels_per_step = levels.map(|k| k.max(1));
    }

    pub fn stats(&self) -> SessionStats {
        self.inner.stats()
    }
}
