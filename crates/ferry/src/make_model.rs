//! `ferry make-model` (being built).

#[derive(Debug, clap::Subcommand)]
pub enum MakeModelCommand {}

pub fn run(cmd: MakeModelCommand) -> anyhow::Result<()> {
    match cmd {}
}
