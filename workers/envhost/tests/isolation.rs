//! A misbehaving environment (one that panics, hangs or is unreachable) costs its own episode and
//! nothing else; a lost episode is rebuilt exactly by replaying its actions.

#![allow(clippy::unwrap_used)] // test helpers may fail loudly

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rollfleet_envhost::{EnvHost, Factory, HostConfig, HostError};
use rollfleet_environments::{EnvError, Environment, Step};

/// The deadline for tests about something other than the deadline.
const RELAXED_DEADLINE: Duration = Duration::from_secs(10);

/// Echoes actions; panics on "boom", hangs on "hang", reports itself unreachable on "gone".
struct Moody;

impl Environment for Moody {
    fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        Ok(format!("ready {seed}"))
    }

    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        match action {
            "boom" => panic!("the environment blew up"),
            "hang" => std::thread::sleep(Duration::from_millis(1500)),
            "gone" => return Err(EnvError::Unavailable("sandbox vanished".into())),
            _ => {}
        }
        Ok(Step {
            observation: format!("echo {action}"),
            reward: 0.0,
            done: action == "stop",
            invalid_action: false,
        })
    }

    fn kind(&self) -> &'static str {
        "moody"
    }
}

/// A host whose step deadline is `step_timeout`. Tests that do not exercise the deadline give it
/// seconds: a panic in a debug build prints its backtrace before the step can answer, and on a
/// loaded two-core machine that alone has taken longer than 300 ms.
fn host(slots: usize, step_timeout: Duration) -> EnvHost {
    let mut factories: BTreeMap<String, Factory> = BTreeMap::new();
    factories.insert("moody".into(), Arc::new(|| Box::new(Moody)));
    EnvHost::new(
        HostConfig {
            slots,
            step_timeout,
        },
        factories,
    )
}

#[tokio::test]
async fn a_panicking_environment_fails_only_its_own_episode() {
    let host = host(4, RELAXED_DEADLINE);
    let (healthy, _) = host.start("moody", 1).await.unwrap();
    let (doomed, _) = host.start("moody", 2).await.unwrap();
    let error = host.step(doomed, "boom").await.unwrap_err();
    assert_eq!(
        error,
        HostError::Infrastructure {
            episode: doomed,
            reason: "the environment panicked: the environment blew up".into()
        }
    );
    assert_eq!(
        host.step(doomed, "again").await.unwrap_err(),
        HostError::UnknownEpisode(doomed)
    );
    assert_eq!(
        host.step(healthy, "hi").await.unwrap().observation,
        "echo hi"
    );
    assert_eq!(host.busy(), 1);
}

#[tokio::test]
async fn a_hanging_environment_is_abandoned_at_its_deadline_and_its_slot_freed() {
    let host = host(1, Duration::from_millis(300));
    let (stuck, _) = host.start("moody", 1).await.unwrap();
    let started = Instant::now();
    let error = host.step(stuck, "hang").await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited {:?}",
        started.elapsed()
    );
    assert!(matches!(error, HostError::Infrastructure { .. }), "{error}");
    // The only slot is free again although the hung thread is still asleep.
    assert!(host.start("moody", 2).await.is_ok());
}

#[tokio::test]
async fn an_unreachable_environment_is_an_infrastructure_failure() {
    let host = host(2, RELAXED_DEADLINE);
    let (id, _) = host.start("moody", 1).await.unwrap();
    let error = host.step(id, "gone").await.unwrap_err();
    assert_eq!(
        error,
        HostError::Infrastructure {
            episode: id,
            reason: "sandbox vanished".into()
        }
    );
}

#[tokio::test]
async fn slots_bound_the_episodes_and_free_up_when_episodes_end() {
    let host = host(2, RELAXED_DEADLINE);
    let (first, _) = host.start("moody", 1).await.unwrap();
    host.start("moody", 2).await.unwrap();
    assert_eq!(
        host.start("moody", 3).await.unwrap_err(),
        HostError::NoFreeSlot(2)
    );
    assert!(host.step(first, "stop").await.unwrap().done);
    assert!(host.start("moody", 3).await.is_ok());
    assert!(matches!(
        host.start("chess", 1).await.unwrap_err(),
        HostError::UnknownEnvironment { .. }
    ));
}

#[tokio::test]
async fn a_lost_sokoban_episode_is_rebuilt_exactly_by_replaying_its_actions() {
    let host = EnvHost::with_builtins(HostConfig {
        slots: 4,
        step_timeout: Duration::from_secs(5),
    });
    let (original, _) = host.start("sokoban", 42).await.unwrap();
    let actions: Vec<String> = ["up", "left", "down", "right", "up"]
        .map(String::from)
        .into();
    let mut last = String::new();
    for action in &actions {
        last = host.step(original, action).await.unwrap().observation;
    }
    let (restored, observation) = host.restore("sokoban", 42, &actions).await.unwrap();
    assert_ne!(original, restored);
    assert_eq!(observation, last);
    let a = host.step(original, "down").await.unwrap();
    let b = host.step(restored, "down").await.unwrap();
    assert_eq!(a, b);
}
