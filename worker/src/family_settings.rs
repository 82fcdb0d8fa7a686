//! The settings each registered model family declares ([`tern_models::family::Family::model_setting`],
//! [`tern_models::family::Family::budget_setting`]) as the worker's flags and environment
//! variables: `--whisper-model` / `TERN_WHISPER_MODEL`, `--image-batch-rows` /
//! `TERN_IMAGE_BATCH_ROWS`, and so on for any family added, in `--help` with the rest; and the
//! settings a family reads when it loads ([`tern_models::family::Family::load_settings`]:
//! `--image-memory` / `TERN_IMAGE_MEMORY`).

use crate::engine::cache::Family;
use crate::engine::ModelNames;
use clap::{Arg, ArgMatches, Command};
use std::collections::HashMap;
use tern_models::family::Setting;

fn arg(setting: Setting) -> Arg {
    // Leaked once, at start: clap keeps its names as &'static str.
    let value_name: &'static str = Box::leak(setting.flag.to_uppercase().replace('-', "_").into_boxed_str());
    let arg = Arg::new(setting.flag).long(setting.flag).env(setting.env).value_name(value_name).help(setting.help);
    match setting.default {
        Some(default) => arg.default_value(default),
        None => arg,
    }
}

/// `command` with every family's model, budget and load settings.
pub fn declare(command: Command) -> Command {
    Family::all().fold(command, |command, family| {
        let plugin = family.plugin();
        let command = command.arg(arg(plugin.model_setting())).arg(arg(plugin.budget_setting()).value_parser(clap::value_parser!(usize)));
        plugin.load_settings().iter().fold(command, |command, &setting| command.arg(arg(setting)))
    })
}

/// The load settings given as flags, as (variable, value): the families read their variables
/// when a model loads, so the worker sets these before it starts any thread
/// ([`std::env::set_var`] is unsound beside threads that read the environment).
pub fn load_settings_from_flags(matches: &ArgMatches) -> Vec<(&'static str, String)> {
    Family::all()
        .flat_map(|family| family.plugin().load_settings().iter())
        .filter(|setting| matches.value_source(setting.flag) == Some(clap::parser::ValueSource::CommandLine))
        .filter_map(|setting| Some((setting.env, matches.get_one::<String>(setting.flag)?.clone())))
        .collect()
}

/// The model serving each family, and the families whose batch budget is set (at least 1).
pub fn read(matches: &ArgMatches) -> (ModelNames, HashMap<Family, usize>) {
    let mut names = ModelNames::defaults();
    let mut budgets = HashMap::new();
    for family in Family::all() {
        let plugin = family.plugin();
        if let Some(name) = matches.get_one::<String>(plugin.model_setting().flag) {
            names.replace(family, name.clone());
        }
        if let Some(&budget) = matches.get_one::<usize>(plugin.budget_setting().flag) {
            budgets.insert(family, budget.max(1));
        }
    }
    (names, budgets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_brings_its_model_and_budget_flags() {
        let command = declare(Command::new("tern-worker"));
        let matches = command.clone().try_get_matches_from(["tern-worker", "--image-model", "hf:stabilityai/sd-turbo", "--transcribe-batch-windows", "0"]).unwrap();
        let (names, budgets) = read(&matches);
        let family = |name| Family::named(name).unwrap();
        assert_eq!(names.of(family("diffusion")), "hf:stabilityai/sd-turbo");
        assert_eq!(names.of(family("whisper")), "whisper-tiny.en", "the family's default");
        assert_eq!(budgets.get(&family("whisper")), Some(&1), "at least 1");
        assert_eq!(budgets.get(&family("llm")), Some(&4096), "the language model's default budget");
        assert_eq!(budgets.get(&family("diffusion")), None, "calibrated");
        let help = command.clone().render_long_help().to_string();
        for flag in ["--whisper-model", "--embed-model", "--llm-model", "--image-model", "--image-batch-rows", "TERN_GENERATE_BATCH_TOKENS", "--image-memory", "TERN_VAE_TILING"] {
            assert!(help.contains(flag), "{flag} in --help");
        }
        assert!(command.clone().try_get_matches_from(["tern-worker", "--image-batch-rows", "many"]).is_err());
        // Only flags given on the command line become variables; defaults stay unset.
        assert!(load_settings_from_flags(&matches).is_empty());
        let matches = command.try_get_matches_from(["tern-worker", "--vae-tiling", "always"]).unwrap();
        assert_eq!(load_settings_from_flags(&matches), vec![("TERN_VAE_TILING", "always".to_string())]);
    }
}
