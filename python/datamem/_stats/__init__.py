"""The stats client's library, one module per concern (the commands over it are
_cli/stats.py and _cli/reload.py):

  discovery.py   the discovery directory: list_processes, registered
  client.py      scraping a TARGET: resolve, fetch, fetch_json, scrape_all
  tables.py      what `top` prints: table, top_text, header, table_all
  sd.py          `ls --prometheus-sd`: sd_targets, write_sd
  reload.py      `reload`: not_ours, datamem_pids, reload_pid, reload_all
  record.py      `record` and `plot`
"""
