//! Runs the Python fake engines of `tests/fakes/` (SGLang's and vLLM's HTTP APIs over a toy
//! model) as real processes for the wire tests, and reads back the JSON line each logs per
//! request.

#![allow(dead_code)] // each test file uses part of it

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::StreamExt;
use rollfleet_engine::{Completion, Engine, GenerateEvent, GenerateRequest, Prompt};

/// A running fake engine; killed on drop.
pub struct Fake {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    log: Arc<Mutex<Vec<serde_json::Value>>>,
    dir: PathBuf,
}

/// A fresh scratch directory under the system's temporary directory.
pub fn scratch_dir(tag: &str) -> anyhow::Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "rollfleet-engine-{tag}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

impl Fake {
    /// Starts `tests/fakes/<script>` with `args` and waits for its port.
    pub fn start(script: &str, args: &[&str]) -> anyhow::Result<Fake> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fakes")
            .join(script);
        let dir = scratch_dir("fake")?;
        let port_file = dir.join("port");
        let mut child = Command::new("python3")
            .arg(&path)
            .args(["--port", "0", "--port-file"])
            .arg(&port_file)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting python3 {}", path.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(value) = serde_json::from_str(&line) {
                    sink.lock().unwrap_or_else(|p| p.into_inner()).push(value);
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(15);
        let port = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file)
                && let Ok(port) = text.trim().parse::<u16>()
            {
                break port;
            }
            if let Some(status) = child.try_wait()? {
                bail!("{script} exited before listening: {status}");
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("{script} did not write its port within 15 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Ok(Fake {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
            dir,
        })
    }

    /// Every logged request so far.
    pub fn log(&self) -> Vec<serde_json::Value> {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The logged requests to `path`.
    pub fn records(&self, path: &str) -> Vec<serde_json::Value> {
        self.log()
            .into_iter()
            .filter(|r| r["path"] == path)
            .collect()
    }

    /// The paths requested so far, in order.
    pub fn paths(&self) -> Vec<String> {
        self.log()
            .iter()
            .filter_map(|r| r["path"].as_str().map(str::to_owned))
            .filter(|p| !p.starts_with('<'))
            .collect()
    }

    /// Waits up to `within` for a logged request to `path`.
    pub async fn wait_for(
        &self,
        path: &str,
        within: Duration,
    ) -> anyhow::Result<serde_json::Value> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(r) = self.records(path).pop() {
                return Ok(r);
            }
            if Instant::now() > deadline {
                bail!(
                    "no request to {path} within {within:?}; log: {:?}",
                    self.paths()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The logged token ids and logprobs of a generation record.
pub fn generated(record: &serde_json::Value) -> anyhow::Result<(Vec<u32>, Vec<f32>)> {
    let ids = record["output_ids"]
        .as_array()
        .context("no output_ids")?
        .iter()
        .map(|v| v.as_u64().map(|v| v as u32).context("id"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let logprobs = record["logprobs"]
        .as_array()
        .context("no logprobs")?
        .iter()
        .map(|v| v.as_f64().map(|v| v as f32).context("logprob"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((ids, logprobs))
}

/// A token-in request for `prompt` under `version`.
pub fn request(id: &str, prompt: Vec<u32>, max_tokens: u32, version: u64) -> GenerateRequest {
    GenerateRequest {
        request_id: id.to_owned(),
        session: "s".to_owned(),
        prompt: Prompt::Tokens(prompt),
        max_tokens,
        temperature: 1.0,
        stop: Vec::new(),
        policy_version: version,
    }
}

/// Runs a generation to its end: the concatenated tokens and logprobs and the completion.
pub async fn run(
    engine: &dyn Engine,
    request: GenerateRequest,
) -> anyhow::Result<(Vec<u32>, Vec<f32>, Completion)> {
    let mut stream = engine.generate(request);
    let (mut ids, mut logprobs) = (Vec::new(), Vec::new());
    while let Some(event) = stream.next().await {
        match event? {
            GenerateEvent::Delta {
                token_ids,
                logprobs: l,
                ..
            } => {
                ids.extend(token_ids);
                logprobs.extend(l);
            }
            GenerateEvent::Finished(done) => return Ok((ids, logprobs, done)),
        }
    }
    bail!("the stream ended without Finished")
}

/// Builds a two-turn conversation turn by turn as a token-in worker does (the first rendering,
/// the policy's sampled answer, then `chat_turn_tokens` for the observation) and checks that it
/// is the template's own rendering of the whole conversation, for an answer that ended on the
/// end-of-turn token and for one cut by the length limit.
pub async fn assert_turns_render_the_whole_conversation(engine: &dyn Engine) -> anyhow::Result<()> {
    use rollfleet_engine::{ChatMessage, chat_turn_tokens};
    let task = [ChatMessage::new("user", "hello there")];
    let observation = ChatMessage::new("user", "the door opens");
    let whole = [
        task[0].clone(),
        ChatMessage::new("assistant", "north"),
        observation.clone(),
    ];
    let rendered = engine.tokenize_chat(&whole, true).await?;
    let first = chat_turn_tokens(engine, true, &task, None).await?;
    anyhow::ensure!(
        rendered.starts_with(&first),
        "the first turn is the rendering's start"
    );
    // The toy template renders the one-word answer as one token, then <|im_end|> (2) and a
    // newline (3); the policy samples the word and <|im_end|>, where it stops.
    let answer = rendered[first.len()];
    anyhow::ensure!(rendered[first.len() + 1..first.len() + 3] == [2, 3]);
    for sampled in [vec![answer, 2], vec![answer]] {
        let mut context = first.clone();
        context.extend_from_slice(&sampled);
        let delta = chat_turn_tokens(
            engine,
            false,
            std::slice::from_ref(&observation),
            context.last().copied(),
        )
        .await?;
        context.extend_from_slice(&delta);
        anyhow::ensure!(
            context == rendered,
            "after the sampled {sampled:?}, the context {context:?} is not the template's \
             rendering {rendered:?}"
        );
    }
    Ok(())
}
