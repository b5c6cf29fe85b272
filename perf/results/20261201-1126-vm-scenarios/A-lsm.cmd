== scenario A-lsm: pinq bench --producers 2 --broker-cpus 0 --client-cpus 1 --consumers 2 --size 100 --duration 10s --storage lsm
