//! `rollfleet completion SHELL`: a shell completion script for `rollfleet`, generated from the
//! same clap definition that parses the command line, so that it never lags behind a new flag.

use std::io::Write;

use anyhow::Result;
use clap_complete::Shell;

use crate::output::exit;

/// Arguments of `rollfleet completion`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:\n  \
    rollfleet completion bash > ~/.local/share/bash-completion/completions/rollfleet\n  \
    rollfleet completion zsh > ~/.zfunc/_rollfleet   # with fpath+=(~/.zfunc) before compinit\n  \
    rollfleet completion fish > ~/.config/fish/completions/rollfleet.fish")]
pub struct CompletionArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: Shell,
}

/// Writes the script for `command` (the whole `rollfleet` command) to `stdout`.
pub fn run(
    args: &CompletionArgs,
    mut command: clap::Command,
    stdout: &mut dyn Write,
) -> Result<u8> {
    // Generated into memory first: clap_complete panics on a failed write, and a closed pipe
    // (`rollfleet completion bash | head`) must end the command cleanly instead.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "rollfleet", &mut script);
    stdout.write_all(&script)?;
    stdout.flush()?;
    Ok(exit::OK)
}
