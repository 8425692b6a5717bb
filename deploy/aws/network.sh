#!/usr/bin/env bash
# Creates what ray_cluster.yaml expects before `ray up`: one security group for every node and an EFS
# file system for the shared storage, then prints the ids to put in place of sg-REPLACE_ME,
# subnet-REPLACE_ME and fs-REPLACE_ME.
#
#   ADMIN_CIDR=203.0.113.7/32 VPC_ID=vpc-... SUBNET_ID=subnet-... bash deploy/aws/network.sh
#
# Rules: SSH (22) from ADMIN_CIDR only (your workstation or bastion: a /32 or your VPN's range);
# everything between cluster nodes (the group itself); NFS (2049) from the group to EFS. Nothing is
# opened to 0.0.0.0/0: the dashboard, job API and MLflow listen on the head's 127.0.0.1 and are
# reached through the SSH tunnel (`ray dashboard ray_cluster.yaml`).
set -euo pipefail
: "${ADMIN_CIDR:?set ADMIN_CIDR to the address range allowed to SSH to the head, e.g. 203.0.113.7/32}"
: "${VPC_ID:?set VPC_ID}"
: "${SUBNET_ID:?set SUBNET_ID (in the availability zone of ray_cluster.yaml)}"
REGION="${AWS_REGION:-us-east-1}"
NAME="${CLUSTER_NAME:-planner}"
case "$ADMIN_CIDR" in
  0.0.0.0/0 | ::/0) echo "refusing ADMIN_CIDR=$ADMIN_CIDR: SSH must not be open to the internet" >&2; exit 2 ;;
esac

sg=$(aws ec2 create-security-group --region "$REGION" --vpc-id "$VPC_ID" --group-name "ray-$NAME" \
  --description "Ray cluster $NAME: intra-cluster, SSH from ADMIN_CIDR" --query GroupId --output text)
aws ec2 authorize-security-group-ingress --region "$REGION" --group-id "$sg" \
  --ip-permissions "IpProtocol=-1,UserIdGroupPairs=[{GroupId=$sg}]" \
  "IpProtocol=tcp,FromPort=22,ToPort=22,IpRanges=[{CidrIp=$ADMIN_CIDR,Description=admin-ssh}]" >/dev/null

fs=$(aws efs create-file-system --region "$REGION" --encrypted --performance-mode generalPurpose \
  --throughput-mode elastic --tags "Key=Name,Value=ray-$NAME" --query FileSystemId --output text)
until [ "$(aws efs describe-file-systems --region "$REGION" --file-system-id "$fs" \
  --query 'FileSystems[0].LifeCycleState' --output text)" = available ]; do sleep 5; done
aws efs create-mount-target --region "$REGION" --file-system-id "$fs" --subnet-id "$SUBNET_ID" \
  --security-groups "$sg" >/dev/null

echo "security group: $sg   subnet: $SUBNET_ID   EFS: $fs"
echo "in ray_cluster.yaml replace sg-REPLACE_ME, subnet-REPLACE_ME, fs-REPLACE_ME with these."
