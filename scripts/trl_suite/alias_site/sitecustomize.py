# On PYTHONPATH only in the TRL harness's posttrain runs: every Python process it starts (subprocesses included)
# resolves `trl` to posttrain.
import trl_alias

trl_alias.install()
