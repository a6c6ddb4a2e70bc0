//! FrozenLake: walk from the start (S) to the goal (G) across frozen tiles (F) without falling
//! into a hole (H).
//!
//! The rules are those of Gymnasium's `FrozenLake-v1`: maps are random with a guaranteed path
//! (each tile frozen with probability `frozen_probability`, regenerated until a path from S to G
//! exists), reaching G gives reward 1 and ends the episode, a hole ends it with reward 0, and on
//! a slippery lake the player moves in the intended direction with probability 1/3 and in each
//! of the two perpendicular directions with probability 1/3. The slip draws come from the
//! episode's own seeded generator, so an episode replays exactly.

use std::fmt::Write as _;

use crate::{Direction, EnvError, Environment, Step, parse_direction};
use rollfleet_rng::SplitMix64;

/// Map and episode settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Side of the square map.
    pub size: usize,
    /// Probability that a tile is frozen (walkable) rather than a hole.
    pub frozen_probability: f64,
    /// Whether the ice is slippery.
    pub slippery: bool,
    /// Steps before the episode is cut off (Gymnasium: 100 for 4x4, 200 for 8x8).
    pub max_steps: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            size: 4,
            frozen_probability: 0.8,
            slippery: false,
            max_steps: 100,
        }
    }
}

/// One tile of the lake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tile {
    /// Where the player starts.
    Start,
    /// Walkable ice.
    Frozen,
    /// Ends the episode with reward 0.
    Hole,
    /// Ends the episode with reward 1.
    Goal,
}

/// A lake map, row by row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Map {
    size: usize,
    tiles: Vec<Tile>,
}

impl Map {
    /// Generates a random map with a path from start (top left) to goal (bottom right).
    pub fn generate(config: &Config, rng: &mut SplitMix64) -> Result<Map, EnvError> {
        if config.size < 2 || config.size > 64 {
            return Err(EnvError::InvalidConfig(format!(
                "size must be between 2 and 64, got {}",
                config.size
            )));
        }
        if !(0.05..=1.0).contains(&config.frozen_probability) {
            return Err(EnvError::InvalidConfig(format!(
                "frozen_probability must be between 0.05 and 1, got {}",
                config.frozen_probability
            )));
        }
        let n = config.size;
        for _ in 0..10_000 {
            let mut tiles: Vec<Tile> = (0..n * n)
                .map(|_| {
                    if rng.next_f64() < config.frozen_probability {
                        Tile::Frozen
                    } else {
                        Tile::Hole
                    }
                })
                .collect();
            tiles[0] = Tile::Start;
            tiles[n * n - 1] = Tile::Goal;
            let map = Map { size: n, tiles };
            if map.has_path() {
                return Ok(map);
            }
        }
        Err(EnvError::InvalidConfig(format!(
            "no {n}x{n} map with a path found at frozen_probability {}",
            config.frozen_probability
        )))
    }

    /// Reads a map written as rows of `S`, `F`, `H`, `G`.
    pub fn parse(text: &str) -> Option<Map> {
        let rows: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let size = rows.len();
        let mut tiles = Vec::with_capacity(size * size);
        for row in &rows {
            if row.len() != size {
                return None;
            }
            for c in row.chars() {
                tiles.push(match c {
                    'S' => Tile::Start,
                    'F' => Tile::Frozen,
                    'H' => Tile::Hole,
                    'G' => Tile::Goal,
                    _ => return None,
                });
            }
        }
        (tiles.iter().filter(|t| **t == Tile::Start).count() == 1).then_some(Map { size, tiles })
    }

    fn start(&self) -> usize {
        self.tiles
            .iter()
            .position(|t| *t == Tile::Start)
            .unwrap_or(0)
    }

    fn neighbour(&self, cell: usize, direction: Direction) -> Option<usize> {
        let (dr, dc) = direction.delta();
        let row = (cell / self.size).checked_add_signed(dr)?;
        let column = (cell % self.size).checked_add_signed(dc)?;
        (row < self.size && column < self.size).then_some(row * self.size + column)
    }

    /// Whether the goal can be reached from the start without stepping into a hole.
    pub fn has_path(&self) -> bool {
        let mut seen = vec![false; self.tiles.len()];
        let mut stack = vec![self.start()];
        while let Some(cell) = stack.pop() {
            if std::mem::replace(&mut seen[cell], true) {
                continue;
            }
            if self.tiles[cell] == Tile::Goal {
                return true;
            }
            for direction in Direction::ALL {
                if let Some(next) = self.neighbour(cell, direction)
                    && self.tiles[next] != Tile::Hole
                    && !seen[next]
                {
                    stack.push(next);
                }
            }
        }
        false
    }
}

/// The FrozenLake environment.
#[derive(Debug, Clone)]
pub struct FrozenLake {
    config: Config,
    map: Option<Map>,
    player: usize,
    steps: u32,
    rng: SplitMix64,
}

impl FrozenLake {
    /// A FrozenLake environment with these settings.
    pub fn new(config: Config) -> Self {
        FrozenLake {
            config,
            map: None,
            player: 0,
            steps: 0,
            rng: SplitMix64::new(0),
        }
    }

    /// Starts an episode on a given map; `seed` drives the slips.
    pub fn reset_to(&mut self, map: Map, seed: u64) -> String {
        self.player = map.start();
        self.map = Some(map);
        self.steps = 0;
        self.rng = SplitMix64::new(seed ^ 0x5eed_f0f0);
        self.describe("Reach the goal G without falling into a hole H.")
    }

    fn describe(&self, headline: &str) -> String {
        let mut text = String::new();
        let _ = writeln!(text, "{headline}");
        if let Some(map) = &self.map {
            for row in 0..map.size {
                for column in 0..map.size {
                    let cell = row * map.size + column;
                    text.push(match (cell == self.player, map.tiles[cell]) {
                        (true, _) => '@',
                        (_, Tile::Start) => 'S',
                        (_, Tile::Frozen) => 'F',
                        (_, Tile::Hole) => 'H',
                        (_, Tile::Goal) => 'G',
                    });
                }
                text.push('\n');
            }
        }
        let _ = write!(
            text,
            "You are @. {}Answer with <action>up|down|left|right</action>. Steps left: {}.",
            if self.config.slippery {
                "The ice is slippery: you may slide sideways. "
            } else {
                ""
            },
            self.config.max_steps.saturating_sub(self.steps)
        );
        text
    }

    fn slip(&mut self, intended: Direction) -> Direction {
        if !self.config.slippery {
            return intended;
        }
        let sideways = match intended {
            Direction::Up | Direction::Down => [Direction::Left, Direction::Right],
            Direction::Left | Direction::Right => [Direction::Up, Direction::Down],
        };
        match self.rng.below(3) as usize {
            0 => intended,
            1 => sideways[0],
            _ => sideways[1],
        }
    }
}

impl Environment for FrozenLake {
    fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        self.map = None;
        let map = Map::generate(&self.config, &mut SplitMix64::new(seed))?;
        Ok(self.reset_to(map, seed))
    }

    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        if self.map.is_none() {
            return Err(EnvError::NotRunning);
        }
        self.steps += 1;
        let out_of_steps = self.steps >= self.config.max_steps;
        let Some(intended) = parse_direction(action) else {
            let observation = self.describe(&format!(
                "Invalid action {:?}: answer with one of up, down, left, right.",
                crate::extract_action(action)
            ));
            if out_of_steps {
                self.map = None;
            }
            return Ok(Step {
                observation,
                reward: 0.0,
                done: out_of_steps,
                invalid_action: true,
            });
        };
        let moved = self.slip(intended);
        let Some(map) = self.map.as_ref() else {
            return Err(EnvError::NotRunning);
        };
        if let Some(next) = map.neighbour(self.player, moved) {
            self.player = next;
        }
        let tile = map.tiles[self.player];
        let (reward, ended, headline) = match tile {
            Tile::Goal => (1.0, true, "You reached the goal.".to_owned()),
            Tile::Hole => (0.0, true, "You fell into a hole.".to_owned()),
            _ if moved != intended => (0.0, false, format!("You slipped and went {moved:?}.")),
            _ => (0.0, false, format!("You went {moved:?}.")),
        };
        let observation = self.describe(&headline);
        let done = ended || out_of_steps;
        if done {
            self.map = None;
        }
        Ok(Step {
            observation,
            reward,
            done,
            invalid_action: false,
        })
    }

    fn kind(&self) -> &'static str {
        "frozenlake"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GYM_4X4: &str = "SFFF\nFHFH\nFFFH\nHFFG";

    #[test]
    fn the_shortest_path_on_gymnasiums_4x4_map_reaches_the_goal() {
        let mut env = FrozenLake::new(Config::default());
        env.reset_to(Map::parse(GYM_4X4).unwrap(), 0);
        let path = ["down", "down", "right", "down", "right", "right"];
        let mut last = None;
        for action in path {
            last = Some(env.step(action).unwrap());
        }
        let last = last.unwrap();
        assert_eq!((last.reward, last.done), (1.0, true));
    }

    #[test]
    fn a_hole_ends_the_episode_without_reward() {
        let mut env = FrozenLake::new(Config::default());
        env.reset_to(Map::parse(GYM_4X4).unwrap(), 0);
        env.step("right").unwrap();
        let step = env.step("down").unwrap();
        assert_eq!((step.reward, step.done), (0.0, true));
        assert!(step.observation.starts_with("You fell into a hole."));
    }

    #[test]
    fn walking_into_the_edge_stays_put() {
        let mut env = FrozenLake::new(Config::default());
        env.reset_to(Map::parse(GYM_4X4).unwrap(), 0);
        let step = env.step("up").unwrap();
        assert!(!step.done);
        assert!(
            step.observation.contains("\n@FFF\n"),
            "{}",
            step.observation
        );
    }

    #[test]
    fn generated_maps_always_have_a_path() {
        let config = Config {
            size: 8,
            frozen_probability: 0.6,
            ..Config::default()
        };
        for seed in 0..200 {
            let map = Map::generate(&config, &mut SplitMix64::new(seed)).unwrap();
            assert!(map.has_path(), "seed {seed}");
            assert_eq!(map.tiles[0], Tile::Start);
            assert_eq!(map.tiles[63], Tile::Goal);
        }
    }

    #[test]
    fn slippery_ice_moves_sideways_about_two_thirds_of_the_time() {
        let config = Config {
            slippery: true,
            ..Config::default()
        };
        let mut env = FrozenLake::new(config);
        let mut sideways = 0;
        let trials = 3000;
        for seed in 0..trials {
            env.reset_to(Map::parse("SFF\nFFF\nFFG").unwrap(), seed);
            env.player = 4; // the centre, so every direction is open
            if env
                .step("up")
                .unwrap()
                .observation
                .starts_with("You slipped")
            {
                sideways += 1;
            }
        }
        let share = f64::from(sideways) / trials as f64;
        assert!((share - 2.0 / 3.0).abs() < 0.04, "{share}");
    }

    #[test]
    fn an_episode_replays_exactly_from_its_seed() {
        let config = Config {
            slippery: true,
            size: 8,
            ..Config::default()
        };
        let run = |seed| {
            let mut env = FrozenLake::new(config.clone());
            let mut log = vec![env.reset(seed).unwrap()];
            for action in ["right", "down", "right", "down", "down", "right"] {
                match env.step(action) {
                    Ok(step) => log.push(step.observation),
                    Err(_) => break,
                }
            }
            log
        };
        assert_eq!(run(17), run(17));
    }

    #[test]
    fn malformed_maps_are_refused() {
        assert!(Map::parse("SFX\nFFF\nFFG").is_none());
        assert!(Map::parse("SF\nFFF").is_none());
        assert!(Map::parse("FF\nFG").is_none(), "no start");
    }
}
