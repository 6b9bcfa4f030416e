"""What the server reports of itself: the Prometheus metrics counted as requests run (`metrics`)
and those read at scrape time (`scraped_metrics`)."""
