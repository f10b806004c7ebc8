# Repo root on sys.path for `import common` even without the editable install.
