//! Unit conversion with a calculator tool: a multi-turn tool-use task checked exactly.
//!
//! The task gives a quantity, a target unit and the conversion fact (so the task tests tool use
//! and arithmetic, not memorised constants). Each turn the policy either calls the calculator,
//! `calc: <expression>`, and gets the result back as the next observation, or answers,
//! `answer: <number>`, which ends the episode: reward 1 if the answer equals the true value
//! rounded to three decimals, else 0. Running out of turns without an answer scores 0.

use std::fmt::Write as _;

use crate::expr::evaluate;
use crate::{EnvError, Environment, Step, extract_action};
use rollfleet_rng::SplitMix64;

/// Episode settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Turns (tool calls plus the answer) before the episode is cut off.
    pub max_turns: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config { max_turns: 4 }
    }
}

/// How one unit converts to another: `to = from * scale + offset`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Conversion {
    from: &'static str,
    to: &'static str,
    scale: f64,
    offset: f64,
    fact: &'static str,
}

/// Exact definitions (the international mile, yard and pound of 1959; the US gallon).
const CONVERSIONS: &[Conversion] = &[
    conversion(
        "miles",
        "kilometres",
        1.609_344,
        0.0,
        "1 mile = 1.609344 kilometres",
    ),
    conversion(
        "kilometres",
        "miles",
        1.0 / 1.609_344,
        0.0,
        "1 mile = 1.609344 kilometres",
    ),
    conversion(
        "pounds",
        "kilograms",
        0.453_592_37,
        0.0,
        "1 pound = 0.45359237 kilograms",
    ),
    conversion(
        "kilograms",
        "pounds",
        1.0 / 0.453_592_37,
        0.0,
        "1 pound = 0.45359237 kilograms",
    ),
    conversion(
        "inches",
        "centimetres",
        2.54,
        0.0,
        "1 inch = 2.54 centimetres",
    ),
    conversion("feet", "metres", 0.3048, 0.0, "1 foot = 0.3048 metres"),
    conversion(
        "US gallons",
        "litres",
        3.785_411_784,
        0.0,
        "1 US gallon = 3.785411784 litres",
    ),
    conversion(
        "nautical miles",
        "kilometres",
        1.852,
        0.0,
        "1 nautical mile = 1.852 kilometres",
    ),
    conversion(
        "degrees Celsius",
        "degrees Fahrenheit",
        1.8,
        32.0,
        "F = C * 9 / 5 + 32",
    ),
    conversion(
        "degrees Fahrenheit",
        "degrees Celsius",
        5.0 / 9.0,
        -160.0 / 9.0,
        "C = (F - 32) * 5 / 9",
    ),
];

const fn conversion(
    from: &'static str,
    to: &'static str,
    scale: f64,
    offset: f64,
    fact: &'static str,
) -> Conversion {
    Conversion {
        from,
        to,
        scale,
        offset,
        fact,
    }
}

/// One task instance.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// The quantity to convert.
    pub value: f64,
    /// Its unit.
    pub from: &'static str,
    /// The unit wanted.
    pub to: &'static str,
    /// The conversion fact given to the policy.
    pub fact: &'static str,
    /// The true answer, unrounded.
    pub answer: f64,
}

impl Task {
    /// The task for `seed`.
    pub fn generate(seed: u64) -> Task {
        let mut rng = SplitMix64::new(seed);
        let conversion = CONVERSIONS[rng.below(CONVERSIONS.len() as u64) as usize];
        // Two decimals, between 1 and 1000: the kind of number people convert.
        let value = (100 + rng.below(99_900) as usize) as f64 / 100.0;
        Task {
            value,
            from: conversion.from,
            to: conversion.to,
            fact: conversion.fact,
            answer: value * conversion.scale + conversion.offset,
        }
    }

    /// Whether `answer` equals the true answer rounded to three decimals.
    pub fn check(&self, answer: f64) -> bool {
        let expected = (self.answer * 1000.0).round();
        (answer * 1000.0 - expected).abs() < 1e-6
    }
}

/// The unit-conversion environment.
#[derive(Debug, Clone)]
pub struct UnitConversion {
    config: Config,
    task: Option<Task>,
    turns: u32,
}

impl UnitConversion {
    /// A unit-conversion environment with these settings.
    pub fn new(config: Config) -> Self {
        UnitConversion {
            config,
            task: None,
            turns: 0,
        }
    }

    /// The current task, if an episode is running.
    pub fn task(&self) -> Option<&Task> {
        self.task.as_ref()
    }

    fn turns_left(&self) -> u32 {
        self.config.max_turns.saturating_sub(self.turns)
    }
}

impl Environment for UnitConversion {
    fn reset(&mut self, seed: u64) -> Result<String, EnvError> {
        let task = Task::generate(seed);
        let mut prompt = String::new();
        let _ = write!(
            prompt,
            "Convert {} {} to {}. Fact: {}. Give the answer rounded to 3 decimal places.\n\
             Each turn, either use the calculator with <action>calc: EXPRESSION</action> \
             (numbers, + - * / ^ and parentheses) or finish with <action>answer: NUMBER</action>. \
             Turns left: {}.",
            task.value, task.from, task.to, task.fact, self.config.max_turns
        );
        self.task = Some(task);
        self.turns = 0;
        Ok(prompt)
    }

    fn step(&mut self, action: &str) -> Result<Step, EnvError> {
        let Some(task) = self.task.clone() else {
            return Err(EnvError::NotRunning);
        };
        self.turns += 1;
        let out_of_turns = self.turns >= self.config.max_turns;
        let action = extract_action(action);
        let lower = action.to_ascii_lowercase();
        let mut step = if let Some(expression) = lower.strip_prefix("calc:") {
            let observation = match evaluate(expression) {
                Ok(value) => format!("calc: {} = {value}", expression.trim()),
                Err(error) => format!("calc error: {error}"),
            };
            Step {
                observation,
                reward: 0.0,
                done: false,
                invalid_action: false,
            }
        } else if let Some(answer) = lower.strip_prefix("answer:") {
            let answer = answer.trim().trim_end_matches(task.to).trim();
            let (reward, observation) = match answer.parse::<f64>() {
                Ok(value) if task.check(value) => (1.0, format!("Correct: {value}.")),
                Ok(value) => (0.0, format!("Incorrect: {value}.")),
                Err(_) => (0.0, format!("Not a number: {answer:?}.")),
            };
            Step {
                observation,
                reward,
                done: true,
                invalid_action: false,
            }
        } else {
            Step {
                observation: format!(
                    "Invalid action {action:?}: use calc: EXPRESSION or answer: NUMBER."
                ),
                reward: 0.0,
                done: false,
                invalid_action: true,
            }
        };
        if !step.done {
            if out_of_turns {
                step.done = true;
                step.observation
                    .push_str(" Out of turns without an answer.");
            } else {
                let _ = write!(step.observation, " Turns left: {}.", self.turns_left());
            }
        }
        if step.done {
            self.task = None;
        }
        Ok(step)
    }

    fn kind(&self) -> &'static str {
        "calculator"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed_for(from: &str) -> u64 {
        (0..10_000)
            .find(|s| Task::generate(*s).from == from)
            .unwrap()
    }

    #[test]
    fn a_calculator_call_then_the_right_answer_scores_one() {
        let mut env = UnitConversion::new(Config::default());
        let seed = seed_for("miles");
        let prompt = env.reset(seed).unwrap();
        let task = env.task().unwrap().clone();
        assert!(prompt.contains("1 mile = 1.609344 kilometres"));
        let step = env
            .step(&format!("<action>calc: {} * 1.609344</action>", task.value))
            .unwrap();
        assert!(!step.done);
        let computed: f64 = step
            .observation
            .split(" = ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let step = env.step(&format!("answer: {computed:.3}")).unwrap();
        assert_eq!(
            (step.reward, step.done),
            (1.0, true),
            "{}",
            step.observation
        );
    }

    #[test]
    fn temperature_conversions_include_the_offset() {
        let task = Task::generate(seed_for("degrees Fahrenheit"));
        let expected = (task.value - 32.0) * 5.0 / 9.0;
        assert!((task.answer - expected).abs() < 1e-9);
        assert!(task.check((expected * 1000.0).round() / 1000.0));
    }

    #[test]
    fn a_wrong_or_unparsable_answer_scores_zero_and_ends() {
        let mut env = UnitConversion::new(Config::default());
        env.reset(1).unwrap();
        let answer = env.task().unwrap().answer;
        let step = env.step(&format!("answer: {:.3}", answer + 0.01)).unwrap();
        assert_eq!((step.reward, step.done), (0.0, true));
        env.reset(1).unwrap();
        let step = env.step("answer: about five").unwrap();
        assert_eq!((step.reward, step.done), (0.0, true));
        assert!(step.observation.starts_with("Not a number"));
    }

    #[test]
    fn an_answer_with_its_unit_is_accepted() {
        let mut env = UnitConversion::new(Config::default());
        env.reset(seed_for("feet")).unwrap();
        let answer = env.task().unwrap().answer;
        let step = env.step(&format!("answer: {answer:.3} metres")).unwrap();
        assert_eq!(step.reward, 1.0, "{}", step.observation);
    }

    #[test]
    fn running_out_of_turns_without_an_answer_scores_zero() {
        let mut env = UnitConversion::new(Config { max_turns: 2 });
        env.reset(5).unwrap();
        assert!(!env.step("calc: 1 + 1").unwrap().done);
        let last = env.step("calc: 2 + 2").unwrap();
        assert!(last.done && last.reward == 0.0);
        assert!(
            last.observation
                .ends_with("Out of turns without an answer.")
        );
    }

    #[test]
    fn calculator_errors_are_observations_not_failures() {
        let mut env = UnitConversion::new(Config::default());
        env.reset(2).unwrap();
        let step = env.step("calc: import os").unwrap();
        assert!(step.observation.starts_with("calc error: unexpected 'i'"));
        assert!(!step.invalid_action && !step.done);
    }

    #[test]
    fn every_conversion_is_drawn_for_some_seed() {
        let mut seen: Vec<&str> = (0..2000).map(|s| Task::generate(s).from).collect();
        seen.sort_unstable();
        seen.dedup();
        let mut all: Vec<&str> = CONVERSIONS.iter().map(|c| c.from).collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(seen, all);
    }
}
