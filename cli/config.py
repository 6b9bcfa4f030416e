"""`telerag config`: the settings a server would run with, as YAML (`show`), the defaults
with what each setting means (`defaults`, the text of `config/default.yaml`: a start for a
`--config` file of one's own), the same as the manual's Markdown table (`reference`, the table of
docs/configuration.md) and a Ray cluster's Serve config (`serve`)."""

from __future__ import annotations

import argparse

import yaml

from telerag.cli.preconditions import require_ray
from telerag.cli.runtime_flags import add_cluster_flags, add_runtime_flags, overrides
from telerag.config.settings import defaults_yaml, load_settings, settings_table


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="print the settings (file, environment and flags applied) or the defaults")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="the settings as serve would load them (API keys masked)")
    add_runtime_flags(show)
    show.set_defaults(func=run_show)
    defaults = actions.add_parser("defaults", help="every setting's default and meaning (config/default.yaml)")
    defaults.set_defaults(func=run_defaults)
    reference = actions.add_parser(
        "reference", help="docs/configuration.md's settings table: every setting's default and meaning, in Markdown"
    )
    reference.set_defaults(func=run_reference)
    serve = actions.add_parser(
        "serve", help="the Serve config file of a Ray cluster deployment (serve run, KubeRay's serveConfigV2; deploy/serve.yaml)"
    )
    add_runtime_flags(serve)
    add_cluster_flags(serve, given_how="")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=run_serve)


def run_show(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, overrides(args))
    print(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def run_defaults(args: argparse.Namespace) -> int:
    print(defaults_yaml(), end="")
    return 0


def run_reference(args: argparse.Namespace) -> int:
    print(settings_table(), end="")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    require_ray("config serve")
    from telerag.server.ray_serve.serve_config import serve_config_yaml

    settings = load_settings(args.config, overrides(args))
    print(serve_config_yaml(settings), end="")
    return 0
