"""The packaged defaults (`telerag.config`): settings, prefetch profiles, the question set.
Read with `telerag.config.settings.packaged_config`; copy `default.yaml` to change it."""
