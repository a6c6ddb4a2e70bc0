//! `rollfleet run`: a scheduler and its workers started as real child processes on loopback,
//! live progress while the job runs, and the summary when it ends.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use rollfleet_proto::auth::{ClientAuth, TOKEN_ENV, Token};
use rollfleet_proto::v1::job_service_client::JobServiceClient;
use rollfleet_proto::v1::{JobPhase, JobRef};
use rollfleet_server::Report;
use tonic::transport::Endpoint;

use super::summary::write_summary;
use super::{EngineKind, RunArgs, bad_drift_margin, runtime};
use crate::output::{OutputFormat, counted, exit, write_structured};

/// A token for one run's processes: 192 bits from the OS, as 48 hex digits.
fn fresh_token() -> Result<Token> {
    let mut bytes = [0u8; 24];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").context("opening /dev/urandom")?,
        &mut bytes,
    )
    .context("reading /dev/urandom")?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(Token::parse(&hex, "a fresh token")?)
}

/// Child processes that are killed when dropped.
struct Children(Vec<(String, Child)>);

impl Children {
    /// The first worker that has exited unsuccessfully, with how. (Workers leave with success
    /// once the job ends; the scheduler, first in the list, is watched apart.)
    fn failed_worker(&mut self) -> Option<String> {
        self.0
            .iter_mut()
            .skip(1)
            .find_map(|(name, child)| match child.try_wait() {
                Ok(Some(status)) if !status.success() => Some(format!("{name} exited ({status})")),
                _ => None,
            })
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            if let Ok(None) = child.try_wait() {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

/// Runs `rollfleet run`.
pub fn run(
    args: &RunArgs,
    output: OutputFormat,
    stdout: &mut dyn Write,
    stderr: &mut dyn Write,
) -> Result<u8> {
    let job = match rollfleet_spec::load_job_file(&args.job) {
        Ok(job) => job,
        Err(e) => {
            writeln!(stderr, "error: {e}")?;
            return Ok(exit::INVALID_INPUT);
        }
    };
    if matches!(args.engine.engine, EngineKind::Sglang | EngineKind::Vllm) {
        writeln!(
            stderr,
            "error: rollfleet run starts one worker per pool; --engine sglang and vllm take one \
             engine per replica: start the scheduler, workers and trainer yourself (as \
             examples/external-trainer/run.sh does)"
        )?;
        return Ok(exit::INVALID_INPUT);
    }
    if job.manifest.spec.rl.trainer == rollfleet_spec::TrainerMode::External {
        writeln!(
            stderr,
            "error: {}: the job's trainer is external (rl.trainer: external): rollfleet run \
             starts no trainer; start the scheduler and workers yourself and the trainer with \
             `rollfleet train {} --scheduler URL --checkpoints DIR` (examples/external-trainer/run.sh)",
            args.job.display(),
            args.job.display()
        )?;
        return Ok(exit::INVALID_INPUT);
    }
    let yaml = std::fs::read_to_string(&args.job)?;
    let plan =
        rollfleet_server::JobPlan::from_yaml(&yaml, &args.job.display().to_string(), args.seed)
            .map_err(|e| anyhow!("{e}"))?;
    let name = job.manifest.metadata.name.clone();
    let exe = std::env::current_exe().context("finding the rollfleet binary")?;
    // The processes' own logs go to one file, so they do not scribble over the progress bars.
    let log_path = std::env::temp_dir().join(format!(
        "rollfleet-run-{}-{}.log",
        job.manifest.metadata.name,
        std::process::id()
    ));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating the log {}", log_path.display()))?;
    let report_path = std::env::temp_dir().join(format!(
        "rollfleet-run-{}-{}.json",
        name,
        std::process::id()
    ));
    for (pool, _) in &args.emulate_slowdown {
        let gpu = plan
            .pool_index(pool)
            .is_some_and(|p| plan.pool_role(p) == Some(rollfleet_server::PoolRole::Gpu));
        if !gpu {
            writeln!(
                stderr,
                "error: --emulate-slowdown {pool}=...: job {} has no GPU pool {pool:?}",
                job.manifest.metadata.name
            )?;
            return Ok(exit::INVALID_INPUT);
        }
    }
    if let Some(problem) = bad_drift_margin(args.replan_on_drift) {
        writeln!(stderr, "error: {problem}")?;
        return Ok(exit::INVALID_INPUT);
    }
    let pools = plan.pools_needed();
    let per_pool = args.workers_per_pool.max(1);
    let mut children = Children(Vec::new());
    // The scheduler listens on loopback, where any local user could reach it: the run's
    // processes share a token of their own (one given in ROLLFLEET_TOKEN is used as it is). It
    // travels in their environment, which other users cannot read, not on their command lines.
    let token = match Token::configured(None)? {
        Some(token) => token,
        None => fresh_token()?,
    };

    let mut scheduler = Command::new(&exe);
    scheduler
        .arg("scheduler")
        .arg(&args.job)
        .args(["--listen", "127.0.0.1:0"])
        .args(["--time-scale", &args.time_scale.to_string()])
        .args(["--seed", &args.seed.to_string()])
        .args(["--expect-workers", &(pools.len() * per_pool).to_string()])
        .arg("--report")
        .arg(&report_path)
        .env(TOKEN_ENV, token.expose())
        .stdout(Stdio::piped())
        .stderr(log.try_clone()?);
    if let Some(m) = args.metrics_addr {
        scheduler.args(["--metrics-addr", &m.to_string()]);
    }
    if let Some(margin) = args.replan_on_drift {
        scheduler.args(["--replan-on-drift", &margin.to_string()]);
    }
    let mut child = scheduler.spawn().context("starting the scheduler")?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("no scheduler stdout"))?;
    children.0.push(("scheduler".into(), child));
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .ok_or_else(|| anyhow!("the scheduler did not say where it listens (got {line:?})"))?
        .to_owned();
    let url = format!("http://{addr}");
    match args.engine.engine_url.first() {
        Some(engine) if args.engine.engine == EngineKind::Openai => writeln!(
            stderr,
            "rollfleet run: scheduler on {url}; generation by the OpenAI-compatible engine at \
             {engine}; training and weight syncs are emulated, time scale {}",
            args.time_scale
        )?,
        _ => writeln!(
            stderr,
            "rollfleet run: scheduler on {url}; GPUs are emulated (roofline model), time scale {} \
             (one modelled second takes {})",
            args.time_scale,
            counted(args.time_scale, "wall second", "wall seconds")
        )?,
    }
    for &p in &pools {
        for i in 0..per_pool {
            let pool = plan.pool_name(p).to_owned();
            let mut worker = Command::new(&exe);
            if args.model_environments {
                worker.arg("worker").arg("--model-environments");
            } else {
                worker.arg("worker");
            }
            if plan.pool_role(p) == Some(rollfleet_server::PoolRole::Gpu) {
                worker.args(args.engine.to_args());
            }
            if let Some((_, share)) = args.emulate_slowdown.iter().find(|(name, _)| *name == pool) {
                worker.args(["--emulate-slowdown", &share.to_string()]);
            }
            let child = worker
                .args(["--scheduler", &url])
                .args(["--pool", &pool])
                .args(["--name", &format!("{pool}-{i}")])
                .env(TOKEN_ENV, token.expose())
                .stdout(Stdio::null())
                .stderr(log.try_clone()?)
                .spawn()
                .with_context(|| format!("starting a worker for pool {pool}"))?;
            children.0.push((format!("worker {pool}-{i}"), child));
        }
    }
    writeln!(
        stderr,
        "rollfleet run: processes log to {}",
        log_path.display()
    )?;
    writeln!(
        stderr,
        "rollfleet run: {} for {} {}",
        counted(pools.len() * per_pool, "worker process", "worker processes"),
        if pools.len() == 1 { "pool" } else { "pools" },
        pools
            .iter()
            .map(|&p| plan.pool_name(p))
            .collect::<Vec<_>>()
            .join(", ")
    )?;

    let rt = runtime()?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    let steps = plan.config.steps;
    let trajectories = steps * u64::from(plan.config.rollout_batch_size);
    let watched = rt.block_on(watch(
        &url,
        &token,
        &name,
        steps,
        trajectories,
        deadline,
        &mut children,
    ));
    // The scheduler writes its report and exits once the job ends.
    let (_, sched) = &mut children.0[0];
    let status = loop {
        if let Some(s) = sched.try_wait()? {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if let Err(e) = watched.as_ref() {
        writeln!(stderr, "rollfleet run: {e}")?;
    }
    if watched.is_err() || status.is_none_or(|s| !s.success()) {
        writeln!(
            stderr,
            "rollfleet run: the last lines of {}:",
            log_path.display()
        )?;
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        for line in &lines[lines.len().saturating_sub(20)..] {
            writeln!(stderr, "  {line}")?;
        }
    }
    watched?;
    if status.is_none() {
        bail!(
            "the scheduler did not finish within --timeout {} s",
            args.timeout
        );
    }
    let report: Report = {
        let bytes = std::fs::read(&report_path)
            .with_context(|| format!("reading the report {}", report_path.display()))?;
        let _ = std::fs::remove_file(&report_path);
        serde_json::from_slice::<Report>(&bytes).context("parsing the scheduler's report")?
    };
    if let Some(path) = &args.report {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json)
            .with_context(|| format!("writing the report {}", path.display()))?;
    }
    if let Some(path) = &args.profiles_out {
        let json = serde_json::to_string_pretty(&report.profiles)?;
        std::fs::write(path, json)
            .with_context(|| format!("writing the profiles {}", path.display()))?;
        writeln!(
            stderr,
            "rollfleet run: {} from the workers' replicas written to {} (emulated \
             replicas measure the roofline model's own figures); plan with them: rollfleet plan \
             {} --profiles {}",
            counted(report.profile_samples, "profile sample", "profile samples"),
            path.display(),
            args.job.display(),
            path.display()
        )?;
    }
    match output {
        OutputFormat::Table => write_summary(&report, stdout)?,
        other => write_structured(other, &report, stdout)?,
    }
    Ok(
        if report.phase == "Succeeded" && report.trained_twice.is_empty() {
            exit::OK
        } else {
            exit::FAILED
        },
    )
}

async fn watch(
    url: &str,
    token: &Token,
    job: &str,
    steps: u64,
    trajectories: u64,
    deadline: Instant,
    children: &mut Children,
) -> Result<()> {
    let endpoint = Endpoint::from_shared(url.to_owned())?;
    let mut client = loop {
        match endpoint.connect().await {
            Ok(channel) => {
                break JobServiceClient::with_interceptor(channel, ClientAuth::new(Some(token)));
            }
            Err(e) if Instant::now() > deadline => bail!("cannot reach the scheduler: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let mut stream = client
        .watch(JobRef {
            job: job.to_owned(),
        })
        .await?
        .into_inner();
    let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(4));
    let bar_style = ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos}/{len} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let step_bar = multi.add(ProgressBar::new(steps));
    step_bar.set_style(bar_style.clone());
    step_bar.set_prefix("RL step");
    let traj_bar = multi.add(ProgressBar::new(trajectories));
    traj_bar.set_style(bar_style.clone());
    traj_bar.set_prefix("trajectories");
    let mut pool_bars: Vec<ProgressBar> = Vec::new();
    let hidden = multi.is_hidden();
    let mut last_print = Instant::now();
    loop {
        // A worker that dies (a bad flag, a crash) would leave the job waiting for its pool
        // until the deadline: look at the children between status updates.
        if let Some(failed) = children.failed_worker() {
            bail!("{failed} before the job ended");
        }
        let remaining = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_secs(1));
        let next = tokio::time::timeout(remaining, stream.message()).await;
        let status = match next {
            Err(_) if Instant::now() < deadline => continue,
            Err(_) => bail!("the job did not finish in time"),
            Ok(Err(e)) => bail!("watching the job: {}", e.message()),
            Ok(Ok(None)) => break,
            Ok(Ok(Some(s))) => s,
        };
        step_bar.set_position(status.rl_step);
        traj_bar.set_position(status.trajectories_trained);
        traj_bar.set_message(format!(
            "trained, {} in flight",
            status.trajectories_in_flight
        ));
        while pool_bars.len() < status.pools.len() {
            let b = multi.add(ProgressBar::new(100));
            b.set_style(
                ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos:>3}% busy {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            pool_bars.push(b);
        }
        for (bar, pool) in pool_bars.iter().zip(&status.pools) {
            bar.set_prefix(pool.pool.clone());
            bar.set_position((pool.busy * 100.0).round() as u64);
            bar.set_message(format!("({})", counted(pool.workers, "worker", "workers")));
        }
        // Without a terminal the bars are hidden: print a plain line every few seconds instead.
        if hidden && last_print.elapsed() > Duration::from_secs(5) {
            last_print = Instant::now();
            eprintln!(
                "step {}/{} trajectories trained {}/{} busy: {}",
                status.rl_step,
                steps,
                status.trajectories_trained,
                trajectories,
                crate::commands::job::busy_line(&status.pools)
            );
        }
        if matches!(
            status.phase(),
            JobPhase::Succeeded | JobPhase::Failed | JobPhase::Cancelled
        ) {
            break;
        }
    }
    // `abandon`, not `finish`: finishing fills a bar to its length, which would show every
    // pool 100% busy, and a failed job's steps all done, above a summary that says otherwise.
    step_bar.abandon();
    traj_bar.abandon();
    for b in pool_bars {
        b.abandon();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_worker_that_exits_unsuccessfully_is_named_and_one_that_succeeds_is_not() {
        let spawn =
            |program: &str, args: &[&str]| Command::new(program).args(args).spawn().unwrap();
        let mut children = Children(vec![
            ("scheduler".into(), spawn("sh", &["-c", "exit 3"])),
            ("worker train-0".into(), spawn("true", &[])),
            (
                "worker envs-0".into(),
                spawn("sh", &["-c", "sleep 0.2; exit 2"]),
            ),
        ]);
        let start = Instant::now();
        let failed = loop {
            if let Some(f) = children.failed_worker() {
                break f;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "never noticed");
            std::thread::sleep(Duration::from_millis(20));
        };
        // The scheduler's own exit is watched apart; a worker that left cleanly is no failure.
        assert!(failed.starts_with("worker envs-0 exited"), "{failed}");
        assert!(failed.contains('2'), "{failed}");
    }
}
