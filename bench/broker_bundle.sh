#!/usr/bin/env bash
# A RabbitMQ broker and the worker's Python dependencies, carried to a machine that has neither (the GPU
# machine: no broker, no network, no package installs), so that bench.worker_rate runs there as it does here.
#
#   bash bench/broker_bundle.sh pack    # here: writes the ignored .broker/ (a tarball in parts, and wheels)
#   bash bench/broker_bundle.sh start   # there, from the checkout root: unpack, install the wheels, start
#   PYTHONPATH=/tmp/broker/site python3 -m bench.worker_rate --jobs 4000   # the broker's default URL
#   bash bench/broker_bundle.sh ctl status   # rabbitmqctl against the bundle's broker
#   bash bench/broker_bundle.sh stop
#
# pack copies this machine's Erlang (/usr/lib/erlang) and RabbitMQ (/usr/lib/rabbitmq), only the applications
# the broker boots, and the shared libraries they link against beyond glibc (which must be >= 2.35 there), and
# downloads cp312 manylinux wheels of the worker's dependencies at the versions of this checkout's .venv.
# start unpacks into $BROKER_DIR (once per bundle), installs the wheels into $BROKER_DIR/site, and starts the
# broker as the current user on 127.0.0.1:$BROKER_PORT with every file it writes under $BROKER_DIR.
#
#   BROKER_BUNDLE      the packed folder (default: .broker)
#   BROKER_DIR         where it is unpacked and the broker keeps its state (default: /tmp/broker)
#   BROKER_PORT        AMQP port (default: 5672); Erlang distribution listens on BROKER_PORT + 20000
#   BROKER_EPMD_PORT   port of the Erlang port mapper, shared with any other Erlang node (default: 4369)
#   PYTHON             the interpreter the wheels are installed for, the bench's (default: python3)
set -euo pipefail

bundle="${BROKER_BUNDLE:-.broker}"
dir="${BROKER_DIR:-/tmp/broker}"
port="${BROKER_PORT:-5672}"
python="${PYTHON:-python3}"

# rabbit's .app dependencies, transitively, plus mnesia (which rabbit starts itself): nothing else is loaded
# when no plugin is enabled.
otp_apps="erts kernel stdlib sasl compiler crypto public_key asn1 ssl inets os_mon mnesia syntax_tools tools xmerl"
rabbit_apps="rabbit rabbit_common rabbitmq_prelaunch ra osiris aten gen_batch_server seshat ranch recon
 observer_cli credentials_obfuscation cuttlefish enough jsx amqp10_common syslog sysmon_handler systemd
 stdout_formatter"
# The worker's runtime dependencies and theirs, less what the GPU image has (torch, numpy, safetensors,
# sentencepiece, uvloop, prometheus-client, tqdm): py3langid needs that image's numpy (>= 2). yarl, multidict,
# propcache and typing-extensions come along although the image has them, as older ones than these may be.
wheels="aio-pika aiormq pamqp yarl multidict propcache idna pydantic pydantic-core annotated-types
 typing-inspection typing-extensions pydantic-settings python-dotenv structlog orjson sentencex py3langid"

die() { echo "broker_bundle: $*" >&2; exit 1; }

pack() {
    local erl=/usr/lib/erlang rmq stage="$bundle/stage" app
    rmq=$(echo /usr/lib/rabbitmq/lib/rabbitmq_server-*)
    rm -rf "$bundle" && mkdir -p "$stage"/{erlang/lib,rabbitmq/plugins,rabbitmq/escript,lib}
    cp -a "$erl"/{bin,releases,erts-*} "$stage/erlang/"
    for app in $otp_apps; do cp -a "$erl"/lib/"$app"-[0-9]* "$stage/erlang/lib/"; done
    for app in $rabbit_apps; do cp -a "$rmq"/plugins/"$app"-[0-9]* "$stage/rabbitmq/plugins/"; done
    cp -a "$rmq"/sbin "$stage/rabbitmq/" && cp -a "$rmq/escript/rabbitmqctl" "$stage/rabbitmq/escript/"
    find "$stage" -depth -type d \( -name src -o -name include -o -name doc -o -name examples \) -exec rm -r {} +
    # Debug info is half of each .beam and no part of running it; attributes hold rabbit's boot steps.
    "$erl/bin/erl" -noshell -eval "{ok, _} = beam_lib:strip_files(filelib:wildcard(
        \"$stage/*/{lib,plugins}/*/ebin/*.beam\"), [\"Attr\", \"CInf\"]), halt()."
    # Every library the binaries link against but glibc's own and libstdc++, which this machine's build needs a
    # newer glibc for; the GPU image has a libstdc++ new enough, as torch needs one too.
    find "$stage" -type f \( -name '*.so' -o -perm -u+x \) -exec sh -c 'file "$1" | grep -q ELF && ldd "$1"' _ {} \; |
        awk '/=> \//{print $3}' | sort -u | grep -vE '/lib(c|m|dl|rt|pthread|stdc\+\+)\.so' |
        xargs -I{} cp -L {} "$stage/lib/"
    tar -C "$stage" -czf - erlang rabbitmq lib | split -b 50M -d - "$bundle/erlang-rabbitmq.tgz.part-"
    rm -rf "$stage"
    # Pinned to the checkout's venv, where the worker is tested.
    # shellcheck disable=SC2086
    .venv/bin/python -m pip download -q -d "$bundle/wheels" --no-deps --only-binary=:all: --implementation cp \
        --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        $(.venv/bin/python -c 'import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $wheels)
    du -sh "$bundle"/*
}

# The broker's environment: bundled binaries and libraries first, every path it reads or writes under $dir.
broker_env() {
    export PATH="$dir/erlang/bin:$dir/rabbitmq/sbin:$PATH" LD_LIBRARY_PATH="$dir/lib" HOME="$dir"
    export OPENSSL_MODULES="$dir/lib"  # no provider from the machine's OpenSSL: the built-in ones serve
    export ERL_EPMD_ADDRESS=127.0.0.1 ERL_EPMD_PORT="${BROKER_EPMD_PORT:-4369}"
    export RABBITMQ_NODENAME="broker$port@localhost" RABBITMQ_DIST_PORT=$((port + 20000))
    export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
    export RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf" RABBITMQ_CONFIG_FILE="$dir/rabbitmq.conf"
    export RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config" RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins"
    export RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" RABBITMQ_PID_FILE="$dir/broker.pid"
}

# Unpacks the tarball and installs the wheels, each again only when the bundle changed.
unpack() {
    local parts stamp
    parts=("$bundle"/erlang-rabbitmq.tgz.part-*)
    [ -f "${parts[0]}" ] || die "no $bundle/erlang-rabbitmq.tgz.part-*: run 'pack' here, or set BROKER_BUNDLE"
    stamp=$(cat "${parts[@]}" "$bundle"/wheels/*.whl | cksum)
    [ "$(cat "$dir/.unpacked" 2>/dev/null)" = "$stamp" ] && return
    rm -rf "$dir/erlang" "$dir/rabbitmq" "$dir/lib" "$dir/site" && mkdir -p "$dir/log"
    cat "${parts[@]}" | tar -C "$dir" -xzf -
    # Debian's Erlang scripts (erl, start) name their root: this copy's is $dir/erlang.
    grep -rlI /usr/lib/erlang "$dir/erlang" | xargs -r sed -i "s|/usr/lib/erlang|$dir/erlang|g"
    if "$python" -m pip --version > /dev/null 2>&1; then
        PIP_ROOT_USER_ACTION=ignore "$python" -m pip install -q --no-index --no-deps --target "$dir/site" \
            "$bundle"/wheels/*.whl
    else  # a venv without pip: these wheels install by unzipping alone (no scripts, no .data)
        "$python" -c 'import sys, zipfile
for w in sys.argv[2:]: zipfile.ZipFile(w).extractall(sys.argv[1])' "$dir/site" "$bundle"/wheels/*.whl
    fi
    echo "$stamp" > "$dir/.unpacked"
}

# True once the port answers the AMQP protocol header with a Connection.Start frame.
amqp_answers() {
    "$python" - "$port" <<'EOF' 2>/dev/null
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2) as s:
    s.sendall(b"AMQP\x00\x00\x09\x01")
    sys.exit(0 if s.recv(7)[:3] == b"\x01\x00\x00" else 1)
EOF
}

start() {
    unpack
    echo "PYTHONPATH=$dir/site"
    broker_env
    local missing
    missing=$(ldd "$dir"/erlang/erts-*/bin/{beam.smp,epmd} "$dir"/erlang/lib/crypto-*/priv/lib/crypto.so |
        grep 'not found' || true)
    [ -z "$missing" ] || die "libraries missing on this machine: $missing"
    amqp_answers && { echo "a broker already answers on 127.0.0.1:$port"; return; }
    printf 'listeners.tcp.default = 127.0.0.1:%s\nlog.file.level = warning\n' "$port" > "$RABBITMQ_CONFIG_FILE"
    echo '[].' > "$RABBITMQ_ENABLED_PLUGINS_FILE"
    setsid nohup rabbitmq-server > "$dir/log/startup.log" 2>&1 < /dev/null &
    local server=$! i
    for i in $(seq 60); do
        amqp_answers && { echo "broker $RABBITMQ_NODENAME answers on 127.0.0.1:$port (logs: $dir/log)"; return; }
        kill -0 "$server" 2>/dev/null || { tail -n 30 "$dir/log/startup.log" >&2; die "the broker exited"; }
        sleep 1
    done
    tail -n 30 "$dir/log/startup.log" >&2
    die "no AMQP answer on 127.0.0.1:$port after 60 s (logs: $dir/log)"
}

# SIGTERM makes the broker stop gracefully; it is killed if still there after 30 s.
stop() {
    local pid i
    pid=$(cat "$dir/broker.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null || { echo "no broker running"; return; }
    kill -TERM "$pid"
    for i in $(seq 30); do kill -0 "$pid" 2>/dev/null || { echo "broker stopped"; return; }; sleep 1; done
    kill -KILL "$pid" && echo "broker killed after 30 s"
}

case "${1:-}" in
    pack) pack ;;
    start) start ;;
    stop) stop ;;
    ctl) shift; broker_env; exec rabbitmqctl "$@" ;;
    *) die "usage: $0 pack|start|stop|ctl ARGS" ;;
esac
