"""The server as a process: it listens at once and loads after (`serve`), moves through its life
(`lifecycle`: loading, ready, draining), guards its connections (`connections`) and runs on one
event loop (`event_loop`)."""
