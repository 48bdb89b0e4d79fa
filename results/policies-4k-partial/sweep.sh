# usage: bash .gpu/c/sweep.sh DEADLINE_S CONFIG_FILE   (each line: out_subdir|kvkit args)
export PYTHONPATH=/tmp/site:/tmp/fakepkg:$PWD KVKIT_CACHE=/tmp/kvkit_cache PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
deadline=$1; cfg=$2
mkdir -p /tmp/res /tmp/logs
while IFS='|' read -r out args; do
  [ -z "$out" ] && continue
  case "$out" in \#*) continue;; esac
  ( timeout $deadline python3 -m kvkit.cli $args --device cuda --out /tmp/res/$out --resume > /tmp/logs/$(echo $out | tr / _).log 2>&1; echo "$out rc=$?" >> /tmp/logs/done.txt ) &
done < "$cfg"
wait
cat /tmp/logs/done.txt
for f in /tmp/logs/*.log; do echo "== $f"; tail -c 600 $f; done
tar czf $OUT/res.tgz -C /tmp res logs
