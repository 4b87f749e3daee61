python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
job() { m=$1; f=$2; n=$3; tag=$4; timeout ${5:-400} python3 -m autofuse.cli tune examples.$m:$f --inputs examples.$m:example_inputs --trials $n --db sqlite:///$OUT/$tag.db -v > $OUT/$tag.log 2>&1; echo "rc $? $tag"; python3 -m autofuse.cli show run 1 --db sqlite:///$OUT/$tag.db > $OUT/${tag}_show.txt 2>&1; tail -2 $OUT/$tag.log; }
planjson() { python3 -m autofuse.cli show plan 1 --db sqlite:///$OUT/$1.db --json | python3 -c "import json,sys; print(json.dumps(json.load(sys.stdin)['plan']))" > $OUT/$1_plan.json; }
