from cache_node import log_records

log_records.install()  # this project's log lines cannot be forged by client text (``log_records``)
